"""All-reduce timing rank for PyTorch: `python -m torch_impl.fabric --backend gloo --sizes 4096,33554432`.

Started on every rank by the launcher that starts training (compare/launch/launchers.py); common/fabric.py
does the timing.
gloo reduces CPU tensors, nccl the GPU of this rank's LOCAL_RANK. Mirrors mlx_impl/fabric.py name for name.
"""
from __future__ import annotations

import datetime
import os
import sys

from common.fabric import Collectives, rank_main


def start_collectives(args) -> Collectives:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
    device = torch.device("cpu")
    if args.backend == "nccl" or args.device == "cuda":
        device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.timeout_s),
                            device_id=device if device.type == "cuda" else None)
    return collectives_of(None, None, str(device), finish=dist.destroy_process_group)


def collectives_of(group, stream, device: str, finish=lambda: None) -> Collectives:
    """The timing operations on the started default group: doctor's job above, and a training rank's probe
    of its own all-reduce (launch.py). `group` and `stream` are MLX's; torch has one default group."""
    import torch
    import torch.distributed as dist

    device = torch.device(device)
    rank = dist.get_rank()

    def wait() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def buffer(n: int):
        return torch.zeros(n // 4, dtype=torch.float32, device=device)  # zeros: repeated sums stay finite

    def all_reduce(x) -> None:
        dist.all_reduce(x)
        wait()

    def from_rank0(value: float) -> float:
        mine = torch.tensor([value if rank == 0 else 0.0], dtype=torch.float32, device=device)
        dist.all_reduce(mine)
        return mine.item()

    return Collectives(rank=rank, size=dist.get_world_size(), device=str(device), buffer=buffer,
                       all_reduce=all_reduce, from_rank0=from_rank0, finish=finish)


def main(argv: list[str] | None = None) -> int:
    return rank_main(argv, start_collectives, "torch")


if __name__ == "__main__":
    sys.exit(main())
