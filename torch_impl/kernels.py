"""The kernels torch's model computes with: MLX's twin (mlx_impl/kernels.py) chooses its exp and its bfloat16
matmuls' route by machine; torch's own are vectorised and reach oneDNN already, so each choice is accepted and
torch's own kernel runs. Mirrors mlx_impl/kernels.py name for name.
"""
from __future__ import annotations

import torch

EXP_KINDS = ("native", "fused")


def set_exp(kind: str) -> None:
    """MLX's twin picks the exp of its softmax, cross-entropy and SiLU (--mlx-exp, mlx_impl/fast_exp.py); torch's
    own CPU exp is vectorised already, so there is nothing to choose here and every kind runs torch.exp."""
    if kind not in EXP_KINDS:
        raise ValueError(f"unknown exp {kind!r}; allowed: {', '.join(EXP_KINDS)}")


BF16_MATMUL_KINDS = ("native", "fp32")


def set_bf16_matmul(kind: str) -> None:
    """MLX's twin routes its CPU bf16 matmuls through float32 and the BLAS (--mlx-bf16-matmul); torch's CPU bf16
    matmul reaches oneDNN already, so every kind runs torch's own."""
    if kind not in BF16_MATMUL_KINDS:
        raise ValueError(f"unknown bf16 matmul {kind!r}; allowed: {', '.join(BF16_MATMUL_KINDS)}")


def matmul(a: torch.Tensor, b: torch.Tensor, bf16_kind: str | None = None) -> torch.Tensor:
    """a @ b: MLX's twin is where its bf16 matmuls choose their route (mlx_impl/model.py); here torch's own."""
    return a @ b
