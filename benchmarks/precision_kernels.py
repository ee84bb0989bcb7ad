"""What each framework's kernels do with bf16 inputs, op by op: `python benchmarks/precision_kernels.py`.

For every op of the model's bf16 forward: MLX against torch on the same bf16-rounded inputs (max |diff|
over the largest output, share of elements that differ), and for attention both against a float64 reference computed from the
same bf16 inputs, and against two emulations (q.k scores rounded to bf16 before the softmax, or kept in
float32). Prints a table; docs/precision.md quotes it. CPU, in-process, a few seconds.
"""
from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mlx_impl.model as mm  # noqa: E402
import torch_impl.model as tm  # noqa: E402

rng = np.random.default_rng(0)


def bf16(a: np.ndarray) -> np.ndarray:
    """Round to bf16 (as float32)."""
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).bfloat16().float().numpy()


def to_mx(a):
    return mx.array(a).astype(mx.bfloat16)


def to_torch(a):
    return torch.from_numpy(a).bfloat16()


def from_mx(x):
    return np.array(x.astype(mx.float32))


def from_torch(x):
    return x.detach().float().numpy()


def attention_reference(q, k, v, scale, round_scores: bool | None):
    """float64 (round_scores None) or float32 with scores rounded to bf16 or not, then P and out rounded."""
    T = q.shape[-2]
    dtype = np.float64 if round_scores is None else np.float32
    s = np.einsum("bhqd,bhkd->bhqk", q.astype(dtype), k.astype(dtype)) * dtype(scale)
    if round_scores:
        s = bf16(s)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    if round_scores is None:
        return p @ v
    return bf16(bf16(p) @ v)


def main() -> None:
    rows = []

    def row(name, a, b, note=""):
        rows.append((name, float(np.abs(a - b).max() / np.abs(b).max()), float((a != b).mean()), note))

    # Attention, small's head shape, peaked scores (q, k scaled up) where rounding matters most.
    B, H, T, D = 2, 4, 128, 64
    scale = D ** -0.5
    q, k, v = (bf16(rng.standard_normal((B, H, T, D)) * s) for s in (3, 3, 1))
    m = from_mx(mx.fast.scaled_dot_product_attention(to_mx(q), to_mx(k), to_mx(v), scale=scale, mask="causal"))
    t = from_torch(F.scaled_dot_product_attention(to_torch(q), to_torch(k), to_torch(v), is_causal=True, scale=scale))
    ref = attention_reference(q, k, v, scale, None)
    row("attention: MLX vs float64 reference", m, ref)
    row("attention: torch vs float64 reference", t, ref)
    row("attention: MLX vs emulation, scores rounded to bf16", m, attention_reference(q, k, v, scale, True))
    row("attention: torch vs emulation, scores in float32", t, attention_reference(q, k, v, scale, False))
    row("attention: MLX vs torch", m, t)

    x = bf16(rng.standard_normal((B, H, T, D)))
    rope_m = from_mx(mx.fast.rope(to_mx(x), D, traditional=False, base=10000.0, scale=1.0, offset=0))
    rope_t = from_torch(tm.RoPE(D, 10000.0, T)(to_torch(x)))
    row("RoPE: MLX vs torch (model code)", rope_m, rope_t)

    h, w = bf16(rng.standard_normal((256, 256)) * 5), (1 + 0.1 * rng.standard_normal(256)).astype(np.float32)
    norm_m, norm_t = mm.RMSNorm(256), tm.RMSNorm(256)
    norm_m.weight, norm_t.weight.data = mx.array(w), torch.from_numpy(w)
    row("RMSNorm: MLX vs torch (model code)", from_mx(norm_m(to_mx(h))), from_torch(norm_t(to_torch(h))))

    g, u = bf16(rng.standard_normal((256, 512)) * 3), bf16(rng.standard_normal((256, 512)))
    import mlx.nn as nn
    row("silu(g) * u, bf16 kernels: MLX vs torch", from_mx(nn.silu(to_mx(g)) * to_mx(u)),
        from_torch(F.silu(to_torch(g)) * to_torch(u)), "not used: MLX rounds the sigmoid")
    row("silu(g) * u, model code (float32 SiLU): MLX vs torch",
        from_mx(nn.silu(to_mx(g).astype(mx.float32)).astype(mx.bfloat16) * to_mx(u)),
        from_torch(F.silu(to_torch(g).float()).bfloat16() * to_torch(u)))

    a, b = bf16(rng.standard_normal((1024, 256))), bf16(rng.standard_normal((512, 256)))
    row("matmul 1024x256 @ 256x512: MLX vs torch", from_mx(to_mx(a) @ to_mx(b).T), from_torch(F.linear(to_torch(a), to_torch(b))))

    width = max(len(r[0]) for r in rows)
    print(f"{'op'.ljust(width)}  max|a-b|/max|b|  elements differing")
    for name, diff, share, note in rows:
        print(f"{name.ljust(width)}  {diff:15.2e}  {share:18.2e}  {note}")


if __name__ == "__main__":
    main()
