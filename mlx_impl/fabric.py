"""All-reduce timing rank for MLX: `python -m mlx_impl.fabric --backend ring --sizes 4096,33554432`.

Started on every rank by the launchers that start training; common/fabric.py does the timing. Buffers
live on the default device (the GPU on a Mac) and the sums run on the stream training uses
(mlx_impl/comm.py). Mirrors torch_impl/fabric.py name for name.
"""
from __future__ import annotations

import sys

from common.fabric import Collectives, rank_main


def start_collectives(args) -> Collectives:
    import mlx.core as mx

    from .comm import communication_stream
    from .launch import INIT_BACKEND, pick_device

    device = pick_device(args.device, 0, 2)
    group = mx.distributed.init(backend=INIT_BACKEND.get(args.backend, args.backend), strict=True)
    return collectives_of(group, communication_stream(args), device)


def collectives_of(group, stream, device: str) -> Collectives:
    """The timing operations on a started group: doctor's job above, and a training rank's probe of its
    own all-reduce (launch.py)."""
    import mlx.core as mx

    rank = group.rank()

    def buffer(n: int):
        x = mx.ones(n // 4, dtype=mx.float32)
        mx.eval(x)
        return x

    def all_reduce(x) -> None:
        mx.eval(mx.distributed.all_sum(x, group=group, stream=stream))

    def from_rank0(value: float) -> float:
        mine = mx.array([value if rank == 0 else 0.0], dtype=mx.float32)
        return mx.distributed.all_sum(mine, group=group, stream=stream).item()

    return Collectives(rank=rank, size=group.size(), device=device, buffer=buffer, all_reduce=all_reduce,
                       from_rank0=from_rank0)


def main(argv: list[str] | None = None) -> int:
    return rank_main(argv, start_collectives, "mlx")


if __name__ == "__main__":
    sys.exit(main())
