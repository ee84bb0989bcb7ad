"""Which stream torch's collectives run on: mirrors mlx_impl/comm.py, where the choice matters.

MLX on a Mac GPU must keep its collectives off the GPU stream (Metal's command-buffer watchdog kills a
collective that waits on a slow peer). torch has nothing to choose: gloo runs collectives on its own CPU
threads, which is what `cpu` asks for, and NCCL on its own CUDA streams, which have no watchdog. So the
config field `communication_stream` means the same in both frameworks and changes nothing here, and
`cpu` with nccl is refused for both (common/config.py). Gradient averaging is DDP's (torch_impl/step.py),
so this file has no `average_gradients`.
"""
from __future__ import annotations

STREAM_CHOICES = ("auto", "cpu", "default")


def communication_stream(cfg):
    """None: torch's backends pick their own streams (gloo: CPU threads; NCCL: its CUDA streams)."""
    choice = getattr(cfg, "communication_stream", "auto")
    if choice not in STREAM_CHOICES:
        raise ValueError(f"communication_stream must be one of {', '.join(STREAM_CHOICES)}, got {choice!r}")
    return None
