"""All-reduce timing rank for PyTorch: `python -m torch_impl.probe --backend gloo --sizes 4096,33554432`.

Started on every rank by the launcher that starts training (compare/launch/launchers.py); common/costmodel/probe.py
does the timing.
gloo reduces CPU tensors, nccl the GPU of this rank's LOCAL_RANK. Mirrors mlx_impl/probe.py name for name.
"""
from __future__ import annotations

import datetime
import os

from common.costmodel.probe import Collectives, rank_main

from .comm import collectives_of


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


def main(argv: list[str] | None = None) -> int:
    return rank_main(argv, start_collectives, "torch")


if __name__ == "__main__":
    from common.train.process_exit import exit_now

    exit_now(main())  # no interpreter teardown: 1-1.5 s of a torch process (common/train/process_exit.py)
