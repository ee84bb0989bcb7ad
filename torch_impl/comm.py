"""Which stream torch's collectives run on: mirrors mlx_impl/comm.py, where the choice matters.

MLX on a Mac GPU must keep its collectives off the GPU stream (Metal's command-buffer watchdog kills a
collective that waits on a slow peer). torch has nothing to choose: gloo runs collectives on its own CPU
threads, which is what `cpu` asks for, and NCCL on its own CUDA streams, which have no watchdog. So the
config field `communication_stream` means the same in both frameworks and changes nothing here, and
`cpu` with nccl is refused for both (common/config.py). Gradient averaging is DDP's (torch_impl/step.py),
so this file has no `average_gradients`. `CommCounter` counts the bytes all-reduced, as MLX's does.
"""
from __future__ import annotations

from common.costmodel.probe import Collectives

from torch.utils._python_dispatch import TorchDispatchMode

STREAM_CHOICES = ("auto", "cpu", "default")
ALL_REDUCES = ("_c10d_functional::all_reduce", "c10d::allreduce_")


def communication_stream(cfg):
    """None: torch's backends pick their own streams (gloo: CPU threads; NCCL: its CUDA streams)."""
    choice = getattr(cfg, "communication_stream", "auto")
    if choice not in STREAM_CHOICES:
        raise ValueError(f"communication_stream must be one of {', '.join(STREAM_CHOICES)}, got {choice!r}")
    return None


class CommCounter(TorchDispatchMode):
    """Bytes given to all-reduce by the ops run under it."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.name() in ALL_REDUCES:
            tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        return func(*args, **(kwargs or {}))


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

    def all_gather(x) -> None:  # into one tensor, as FSDP2 gathers a unit's flat parameters
        out = torch.empty(x.numel() * dist.get_world_size(), dtype=x.dtype, device=device)
        dist.all_gather_into_tensor(out, x)
        wait()

    def from_rank0(value: float) -> float:
        mine = torch.tensor([value if rank == 0 else 0.0], dtype=torch.float32, device=device)
        dist.all_reduce(mine)
        return mine.item()

    return Collectives(rank=rank, size=dist.get_world_size(), device=str(device), buffer=buffer,
                       all_reduce=all_reduce, from_rank0=from_rank0, finish=finish, all_gather=all_gather)
