"""All-reduce timing rank for MLX: `python -m mlx_impl.probe --backend ring --sizes 4096,33554432`.

Started on every rank by the launchers that start training; common/costmodel/probe.py does the timing. Buffers
live on the default device (the GPU on a Mac) and the sums run on the stream training uses
(mlx_impl/comm.py). Mirrors torch_impl/probe.py name for name.
"""
from __future__ import annotations


from common.costmodel.probe import Collectives, rank_main

from .comm import collectives_of


def start_collectives(args) -> Collectives:
    import mlx.core as mx

    from .comm import communication_stream
    from .launch import INIT_BACKEND, pick_device

    device = pick_device(args.device, 0, 2)
    group = mx.distributed.init(backend=INIT_BACKEND.get(args.backend, args.backend), strict=True)
    return collectives_of(group, communication_stream(args), device)


def main(argv: list[str] | None = None) -> int:
    return rank_main(argv, start_collectives, "mlx")


if __name__ == "__main__":
    from common.train.process_exit import exit_now

    exit_now(main())  # no interpreter teardown: 1-1.5 s of a torch process (common/train/process_exit.py)
