"""torch's attention core: softmax(q k^T scale + mask) v with its mask, as torch_impl/model.py's Attention calls it.
Mirrors mlx_impl/attention.py name for name: torch's scaled_dot_product_attention is one fused kernel on every
device, so there is nothing to write out or choose here.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ATTENTION_BLOCKS = {"whole": 1, "halves": 2, "quarters": 4}


def set_attention(kind: str) -> None:
    """MLX's twin splits its written-out CPU attention core into blocks of queries (a timed choice); torch's
    scaled_dot_product_attention is one fused, tiled kernel, so every kind runs it."""
    if kind not in ATTENTION_BLOCKS:
        raise ValueError(f"unknown attention {kind!r}; allowed: {', '.join(ATTENTION_BLOCKS)}")


def attention_mask(padding_mask: torch.Tensor | None, T: int) -> torch.Tensor | None:
    if padding_mask is None:
        return None  # is_causal=True: the kernel builds it, no T x T tensor
    device = padding_mask.device
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    keys = padding_mask.bool()[:, None, None, :]  # (B, 1, 1, T): broadcasts over heads, queries
    # The diagonal stays visible so a query at a padded position still has a key; a fully masked
    # row would softmax to NaN.
    return causal & (keys | torch.eye(T, dtype=torch.bool, device=device))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
              mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v, (B, H, T, D) with H a multiple of k's and v's heads (grouped-query):
    torch's fused kernel on every device (mlx_impl/model.py writes MLX's out on a CPU, where MLX has none)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                          enable_gqa=True)
