"""Which stream MLX's collectives run on, gradient averaging that keeps to it, and the bytes they carry.

On a Mac GPU a collective on the GPU stream sits inside a Metal command buffer while it waits for its
peers; when a peer is a few seconds late (a slower Mac, an eval, a checkpoint), Metal's ~5 s watchdog
kills the buffer (kIOGPUCommandBufferCallbackErrorTimeout: mlx issue 4475, mlx-examples 1185). On the
CPU stream the wait happens on a CPU thread instead. The config field `communication_stream` chooses:

    auto     the CPU stream when training on a Metal GPU, the default stream otherwise (CPU runs, and
             CUDA, whose nccl backend reduces GPU memory on the GPU stream)
    cpu      always the CPU stream
    default  MLX's default: the default stream of the default device

torch_impl/comm.py mirrors the choice; there it changes nothing (gloo runs collectives on CPU threads,
NCCL on its own CUDA streams, which have no watchdog).
"""
from __future__ import annotations

from typing import Callable, Iterable, TypeVar, cast

from common.costmodel.probe import Collectives

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

STREAM_CHOICES = ("auto", "cpu", "default")
F = TypeVar("F", bound=Callable)


def communication_stream(cfg):
    """The stream for collectives (`stream=` of mx.distributed ops, `communication_stream=` of
    nn.average_gradients), or None for MLX's default. Call after the default device is set."""
    choice = getattr(cfg, "communication_stream", "auto")
    if choice not in STREAM_CHOICES:
        raise ValueError(f"communication_stream must be one of {', '.join(STREAM_CHOICES)}, got {choice!r}")
    if choice == "cpu" or (choice == "auto" and mx.default_device() == mx.gpu and mx.metal.is_available()):
        return mx.cpu
    return None


def average_gradients(grads, group, all_reduce_size: int, stream=None):
    """nn.average_gradients on `stream`, also for trees of mixed dtypes (bf16 weights with an fp32 value
    riding along): MLX falls back to one all-reduce per array there and drops the stream, so each dtype
    is averaged on its own here."""
    flat = tree_flatten(grads)
    dtypes = {value.dtype for _, value in flat}
    if len(dtypes) <= 1:
        return nn.average_gradients(grads, group=group, all_reduce_size=all_reduce_size,
                                    communication_stream=stream)
    averaged = []
    for dtype in sorted(dtypes, key=str):
        part = {key: value for key, value in flat if value.dtype == dtype}
        averaged += tree_flatten(nn.average_gradients(part, group=group, all_reduce_size=all_reduce_size,
                                                      communication_stream=stream))
    order = {key: i for i, (key, _) in enumerate(flat)}
    return tree_unflatten(sorted(averaged, key=lambda item: order[item[0]]))


class CommCounter:
    """The step's communication as a strategy sees it (the `comm` every strategy is built with, as in
    torch_impl/comm.py): the stream collectives run on, and the bytes given to all-reduce, counted as
    collectives are traced and attributed to the compiled function whose trace issued them (`per_call`): a
    compiled function issues the same ones at every call."""

    def __init__(self, stream: mx.Stream | mx.DeviceType | None = None):
        self.stream = stream  # communication_stream(cfg): the CPU stream on a Metal GPU, else None
        self.traced_bytes, self.per_call = 0, dict[str, int]()

    def add(self, x: mx.array) -> None:
        self.traced_bytes += x.size * x.dtype.size

    def add_all(self, arrays: Iterable[mx.array]) -> None:
        for x in arrays:
            self.add(x)

    def attribute(self, name: str, fn: F) -> F:
        def call(*args):
            before = self.traced_bytes
            out = fn(*args)
            if self.traced_bytes > before:  # traced just now
                self.per_call[name] = self.traced_bytes - before
            return out
        return cast(F, call)

    def each_call(self, fn: F) -> F:
        """`fn`, compiled, counted at every call as if it ran uncompiled: the bytes its trace counted for the
        inputs' shapes and dtypes, added again at each later call of the same (a compiled function traces once
        per shapes, and issues the same collectives at every call). pp x tp's last stage runs its tp all-reduces
        inside one compiled vjp per piece, and its forward_backward counts a micro-step's bytes piece by piece."""
        traced: dict[tuple, int] = {}

        def call(*args):
            key = tuple((tuple(a.shape), a.dtype) if isinstance(a, mx.array) else None for a in args)
            before = self.traced_bytes
            out = fn(*args)
            if key in traced:
                self.traced_bytes += traced[key]
            else:
                traced[key] = self.traced_bytes - before
            return out
        return cast(F, call)

    def bytes_per_step(self, grad_accum: int) -> int | None:
        """Bytes given to all-reduce by one step's micro-steps and update, and those a strategy gives once per
        step outside them ("step": pp's tied gradient); scalars left out."""
        return (self.per_call.get("micro_step", 0) * grad_accum + self.per_call.get("update", 0)
                + self.per_call.get("step", 0))


def collectives_of(group, stream, device: str) -> Collectives:
    """The timing operations on a started group: doctor's job above, and a training rank's probe of its
    own all-reduce (launch.py)."""
    rank = group.rank()

    def buffer(n: int):
        x = mx.ones(n // 4, dtype=mx.float32)
        mx.eval(x)
        return x

    def all_reduce(x) -> None:
        mx.eval(mx.distributed.all_sum(x, group=group, stream=stream))

    def all_gather(x) -> None:
        mx.eval(mx.distributed.all_gather(x, group=group, stream=stream))

    def from_rank0(value: float) -> float:
        mine = mx.array([value if rank == 0 else 0.0], dtype=mx.float32)
        return cast(float, mx.distributed.all_sum(mine, group=group, stream=stream).item())  # a float32 array

    def group_all_reduce(group_size: int, across: bool = False):
        """An all-reduce over this rank's group of `group_size` consecutive ranks, or across=True over the ranks
        at its place in every such group; None where the backend has no split (the ring: "[ring] Group split not
        supported")."""
        place, machine = rank % group_size, rank // group_size
        try:
            sub = group.split(place, machine) if across else group.split(machine, place)
        except (RuntimeError, ValueError):
            return None

        def all_reduce_in_group(x) -> None:
            mx.eval(mx.distributed.all_sum(x, group=sub, stream=stream))
        return all_reduce_in_group

    return Collectives(rank=rank, size=group.size(), device=device, buffer=buffer, all_reduce=all_reduce,
                       from_rank0=from_rank0, all_gather=all_gather, group_all_reduce=group_all_reduce)
