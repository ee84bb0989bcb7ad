"""The gradient norm and the clip every torch strategy shares: a precise norm, and torch's clip formula with it.
Mirrors mlx_impl/grads.py."""
from __future__ import annotations

from typing import Iterable

import torch

from .load import local
from .microsteps import Grads


def norm_dtype(device: torch.device) -> torch.dtype:
    """What the gradient norm is summed in: float64, or float32 on MPS, which has no float64. A float32 norm of a
    big embedding gradient is off by ~3e-5 (measured on `small`), and the clip coefficient with it."""
    return torch.float32 if device.type == "mps" else torch.float64


def sum_of_squares(x: torch.Tensor, dtype: torch.dtype = torch.float64, width: int = 1024) -> torch.Tensor:
    """Sum of x², in `dtype`: float32 norms of rows of `width` elements (short sums), squared and summed in
    `dtype`. Casting every element to float64 first, as vector_norm(dtype=float64) does, made the norm of
    `small`'s 28M gradients 69 ms of a step on the 2-core Zen 5 VM (2 threads); this takes 3.4 ms and is
    within 1e-9 of the float64 norm, where one flat float32 norm per tensor was 4.5e-4 off (gradients with a
    mean, issue 27). mlx_impl/grads.py's sum_of_squares is the same idea as a tree of sums."""
    flat = x.detach().reshape(-1)
    n = flat.numel() // width * width
    norms = [torch.linalg.vector_norm(flat[:n].view(-1, width), dim=1)] if n else []
    if n < flat.numel():
        norms.append(torch.linalg.vector_norm(flat[n:]).reshape(1))
    return torch.cat(norms).to(dtype).square().sum() if norms else torch.zeros((), dtype=dtype, device=x.device)


def squares_of(tensors: Iterable[torch.Tensor], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Sum of x² over every tensor, in `dtype` (sum_of_squares each, then their sum; zero where there are none).
    mlx_impl/grads.py's squares_of sums the same, in float32, in fewer kernels."""
    tensors = list(tensors)
    return torch.stack([sum_of_squares(t, dtype) for t in tensors]).sum() if tensors else \
        torch.zeros((), dtype=dtype, device=device)


def clip_by_norm(grads: Grads, max_norm: float, norm: torch.Tensor) -> None:
    """torch's clip formula, in place, with the precise norm (and on a DTensor's local shard, where a
    DTensor gradient would need the same mesh as the norm)."""
    torch._foreach_mul_([local(g) for g in grads], torch.clamp(max_norm / (norm + 1e-6), max=1.0))
