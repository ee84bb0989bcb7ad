"""The gradient norm and the clip every MLX strategy shares: a precise norm, and clip_grad_norm's formula with it.
Mirrors torch_impl/grads.py."""
from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_map

from .microsteps import Grads


def sum_of_squares(x: mx.array, width: int = 4) -> mx.array:
    """Sum of x², as a tree of sums of `width` terms: a flat float32 sum over the millions of elements of
    an embedding gradient is off by ~4e-5, and the clip coefficient with it (measured on `small`)."""
    x = x.astype(mx.float32).reshape(-1)
    x = x * x
    while x.size > width:
        if x.size % width:
            x = mx.concatenate([x, mx.zeros((width - x.size % width,), dtype=x.dtype)])
        x = x.reshape(-1, width).sum(axis=1)
    return x.sum()


def clip_by_norm(grads: Grads, max_norm: float, norm: mx.array) -> Grads:
    """optim.clip_grad_norm's (and torch's) formula, with the precise norm."""
    return tree_map(lambda g: g * mx.minimum(max_norm / (norm + 1e-6), 1.0), grads)
