"""Which stream torch's collectives run on: mirrors mlx_impl/comm.py, where the choice matters.

MLX on a Mac GPU must keep its collectives off the GPU stream (Metal's command-buffer watchdog kills a
collective that waits on a slow peer). torch has nothing to choose: gloo runs collectives on its own CPU
threads, which is what `cpu` asks for, and NCCL on its own CUDA streams, which have no watchdog. So the
config field `communication_stream` means the same in both frameworks and changes nothing here, and
`cpu` with nccl is refused for both (common/config.py). Gradient averaging is DDP's (torch_impl/ddp.py),
so this file has no `average_gradients`.

`CommCounter` is the `comm` every strategy is built with, as in MLX: the stream, and the bytes one training step
gives to collectives. MLX counts them as its compiled functions are traced; here each strategy counts its first
training step (its shapes are those of every step) with what sees its collectives: `AllReduceCounter` (a dispatch
mode: tp), `SendCounter` (pp's point-to-point sends), or a `FixedCount` where the bytes are known without watching
(DDP's C++ buckets, which no dispatch mode sees) or not counted (FSDP2's reduce-scatters and all-gathers).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Protocol

from common.costmodel.probe import Collectives

from torch.utils._python_dispatch import TorchDispatchMode

STREAM_CHOICES = ("auto", "cpu", "default")
ALL_REDUCES = ("_c10d_functional::all_reduce", "c10d::allreduce_")
SENDS = ("c10d::send",)


def communication_stream(cfg):
    """None: torch's backends pick their own streams (gloo: CPU threads; NCCL: its CUDA streams)."""
    choice = getattr(cfg, "communication_stream", "auto")
    if choice not in STREAM_CHOICES:
        raise ValueError(f"communication_stream must be one of {', '.join(STREAM_CHOICES)}, got {choice!r}")
    return None


class Watch(Protocol):
    """What a strategy counts its first step with: a context manager that knows the bytes afterwards."""

    @property
    def bytes(self) -> int | None: ...

    def __enter__(self) -> object: ...

    def __exit__(self, kind: Any, value: Any, traceback: Any, /) -> object: ...


class CommCounter:
    """The step's communication as a strategy sees it (mirrors mlx_impl/comm.py's): the stream collectives run
    on (None here: gloo and NCCL pick their own), and the bytes one training step gives to collectives, counted
    on the first training step (scalars left out)."""

    def __init__(self, stream: None = None):
        self.stream = stream
        self.per_step: int | None = None
        self.counted = False

    @contextlib.contextmanager
    def first_step(self, watch: Callable[[], Watch]) -> Iterator[None]:
        """The first training step's passes run under `watch()`, and what it counted is every step's; later
        steps run unwatched."""
        if self.counted:
            yield
            return
        watcher = watch()
        with watcher:
            yield
        self.per_step, self.counted = watcher.bytes, True

    def bytes_per_step(self, grad_accum: int) -> int | None:
        """Bytes given to collectives by one step's forward and backward passes (the first step's; every
        micro-step counted already)."""
        return self.per_step


class FixedCount(contextlib.nullcontext):
    """A Watch whose bytes are known without watching: DDP's buckets; None: not counted (FSDP2's)."""

    def __init__(self, nbytes: int | None):
        super().__init__()
        self.bytes = nbytes


class AllReduceCounter(TorchDispatchMode):
    """Bytes given to all-reduce by the ops run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.name() in ALL_REDUCES:
            tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        return func(*args, **(kwargs or {}))


class SendCounter(TorchDispatchMode):
    """Bytes given to point-to-point sends by the ops run under it (pp's activations and their gradients), and
    to all-reduces of more than one element (pp's tied gradient; its barriers are scalars, left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.name() in SENDS + ALL_REDUCES:
            # floating point only: the first step's shape inference sends pickled bytes
            tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            self.bytes += sum(t.numel() * t.element_size() for t in tensors
                              if t.is_floating_point() and (func.name() in SENDS or t.numel() > 1))
        return func(*args, **(kwargs or {}))


def collectives_of(group, stream, device: str, finish=lambda: None) -> Collectives:
    """The timing operations on the started default group: doctor's job above, and a training rank's probe
    of its own all-reduce (launch.py). `group` and `stream` are MLX's; torch has one default group."""
    import torch
    import torch.distributed as dist

    where = torch.device(device)
    rank = dist.get_rank()

    def wait() -> None:
        if where.type == "cuda":
            torch.cuda.synchronize(where)

    def buffer(n: int):
        return torch.zeros(n // 4, dtype=torch.float32, device=where)  # zeros: repeated sums stay finite

    def all_reduce(x) -> None:
        dist.all_reduce(x)
        wait()

    def all_gather(x) -> None:  # into one tensor, as FSDP2 gathers a unit's flat parameters
        out = torch.empty(x.numel() * dist.get_world_size(), dtype=x.dtype, device=where)
        dist.all_gather_into_tensor(out, x)
        wait()

    def from_rank0(value: float) -> float:
        mine = torch.tensor([value if rank == 0 else 0.0], dtype=torch.float32, device=where)
        dist.all_reduce(mine)
        return mine.item()

    def group_all_reduce(group_size: int, across: bool = False):
        """An all-reduce over this rank's group of `group_size` consecutive ranks, or across=True over the ranks
        at its place in every such group (every rank makes every group)."""
        world = dist.get_world_size()
        if across:
            sub, _ = dist.new_subgroups_by_enumeration([list(range(p, world, group_size)) for p in range(group_size)])
        else:
            sub, _ = dist.new_subgroups(group_size)

        def all_reduce_in_group(x) -> None:
            dist.all_reduce(x, group=sub)
            wait()
        return all_reduce_in_group

    return Collectives(rank=rank, size=dist.get_world_size(), device=str(where), buffer=buffer,
                       all_reduce=all_reduce, from_rank0=from_rank0, finish=finish, all_gather=all_gather,
                       group_all_reduce=group_all_reduce)
