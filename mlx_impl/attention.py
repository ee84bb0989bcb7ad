"""MLX's attention core: softmax(q k^T scale + mask) v with its mask, as mlx_impl/model.py's Attention calls it.
Mirrors torch_impl/attention.py name for name.

On a Metal GPU MLX's fused kernel; on a CPU, where MLX has none, written out and fused by mx.compile (`_attend`,
issue 58), whole or in blocks of queries (a timed choice, common/kernels.py). The exp, the row max and the softmax
it uses are mlx_impl/kernels.py's, as the rest of the model's are.
"""
from __future__ import annotations

from typing import cast

import mlx.core as mx
import numpy as np

from . import kernels

ATTENTION_BLOCKS = {"whole": 1, "halves": 2, "quarters": 4}
_ATTENTION = {"kind": "whole"}


def set_attention(kind: str) -> None:
    """How the float32 attention core on a CPU splits its queries from now on (traced, as set_exp; auto times
    them): "whole", or "halves"/"quarters", blocks of consecutive queries (`_attend_in_blocks`)."""
    if kind not in ATTENTION_BLOCKS:
        raise ValueError(f"unknown attention {kind!r}; allowed: {', '.join(ATTENTION_BLOCKS)}")
    _ATTENTION["kind"] = kind


def attention_mask(padding_mask: mx.array | None, T: int) -> mx.array | str:
    if padding_mask is None:
        return "causal"  # the fused kernel builds it, no T x T array
    causal = mx.tril(mx.ones((T, T), dtype=mx.bool_))
    keys = padding_mask.astype(mx.bool_)[:, None, None, :]  # (B, 1, 1, T): broadcasts over heads, queries
    # The diagonal stays visible so a query at a padded position still has a key; a fully masked
    # row would softmax to NaN.
    return causal & (keys | mx.eye(T, dtype=mx.bool_))


def _causal_mask(T: int) -> mx.array:
    return mx.arange(T)[:, None] >= mx.arange(T)[None]


_CAUSAL_BIAS: dict[int, mx.array] = {}


def _causal_bias(T: int) -> mx.array:
    """The causal mask as the (T, T) bias the scores' matmul adds (0 or -inf), made once per length from numpy, so
    a compiled step holds it as a constant: built inside the step (arange, compare, where) and given a zeros
    cotangent, it cost 0.2-0.4 ms of a demo layer's 4.1-4.5 ms core (benchmarks/bench_attention.py: the model's
    core against the same core handed a bias made outside)."""
    if T not in _CAUSAL_BIAS:
        if len(_CAUSAL_BIAS) >= 32:  # sampling grows T token by token: keep a bound
            _CAUSAL_BIAS.clear()
        _CAUSAL_BIAS[T] = mx.array(np.where(np.tri(T, dtype=bool), 0.0, -np.inf).astype(np.float32))
    return _CAUSAL_BIAS[T]


def attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array | str) -> mx.array:
    """softmax(q k^T * scale + mask) v, (B, H, T, D) with H a multiple of k's and v's heads (grouped-query).

    On a Metal GPU: MLX's fused kernel (mx.fast.scaled_dot_product_attention). On a CPU that kernel is not
    fused: MLX computes it with its softmax primitive and the prebuilt exp (7.4 ms per layer of a 29 ms tiny
    forward, issue 27). Written out here and fused by mx.compile instead: in float32 as `_attend` (the mask as a
    bias added by the scores' matmul, the normalisation after P v, a backward written as torch's CPU
    flash-attention kernel computes it: 1.6-1.8x faster forward + backward, benchmarks/bench_attention.py); in
    bfloat16 step by step, rounding at the same points as MLX's kernel (q * scale and the scores in the input
    dtype, softmax in float32, P rounded to the input dtype, P v in it: docs/precision.md)."""
    if mx.default_device() == mx.gpu:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    B, H, T, D = q.shape
    causal = isinstance(mask, str)
    mask = _causal_mask(T) if isinstance(mask, str) else mask
    if H != k.shape[1]:  # each k/v head serves H / kv_heads query heads: (B, kv_heads, H / kv_heads, T, D)
        q = q.reshape(B, k.shape[1], H // k.shape[1], T, D)
        k, v = k[:, :, None], v[:, :, None]
        if mask.ndim == 4:
            mask = mask[:, :, None]
    q = q * mx.array(scale, dtype=q.dtype)
    if q.dtype == mx.float32:
        bias = _causal_bias(T) if causal else mx.where(mask, mx.array(0.0), mx.array(-mx.inf))
        return _attend_in_blocks(q, k, v, bias, ATTENTION_BLOCKS[_ATTENTION["kind"]]).reshape(B, H, T, D)
    scores = kernels.matmul(q, k.swapaxes(-1, -2))
    scores = mx.where(mask, scores, mx.array(-mx.inf, dtype=scores.dtype))
    return kernels.matmul(kernels._SOFTMAX[kernels._EXP["kind"]](scores), v).reshape(B, H, T, D)


@mx.custom_function
def _attend(q: mx.array, k: mx.array, v: mx.array, bias: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """(softmax(q k^T + bias) v, E, l), float32, q already scaled: E = exp(S - row max) unnormalised and l its row
    sums, so that P v is computed as (E v) / l (a T x D division, not T x T) and the backward reads E and l
    instead of computing them again. l comes out of the same matmul as E v, by a column of ones appended to v
    (one reduction over T x T fewer). Each change measured against the step-by-step form in one sitting (Intel
    Xeon VM, docs/notes/2026-11-attention-cpu.md): the bias added by the matmul (addmm) instead of a `where`, the
    shift subtracted before the exp, the division after P v, the ones column."""
    scores = mx.addmm(bias, q, k.swapaxes(-1, -2))
    e = kernels._exp(scores - mx.stop_gradient(kernels._row_max(scores)))
    out_and_rows = e @ _with_ones(v)
    rows = out_and_rows[..., -1:]
    return out_and_rows[..., :-1] / rows, e, rows


def _attend_in_blocks(q: mx.array, k: mx.array, v: mx.array, bias: mx.array, blocks: int) -> mx.array:
    """`_attend`'s output, its queries in `blocks` runs of consecutive positions, each against the keys up to its
    last one: the mask is causal (attention_mask), so the keys after a block's last query weigh nothing, and
    leaving them out gives the same values. The work falls to (blocks + 1) / (2 blocks) of the T x T scores, and
    each block's scores take a fraction of the cache; each block is one more set of kernels to dispatch. Measured
    (benchmarks/bench_attention.py, fwd + bwd of one layer, Intel Xeon VM): `small`'s layer (8 x 4 heads x 256,
    8 MB of scores) 43.6 -> 29.2 ms in halves, torch 25.0; the demo's (2 MB) 4.45 -> 4.30, within its spread,
    and at a batch of one 0.63 -> 1.32, all dispatch. So it is a timed choice (common/kernels.py)."""
    T = q.shape[-2]
    if blocks <= 1 or T < blocks:
        return cast(tuple, _attend(q, k, v, bias))[0]
    edges = [T * i // blocks for i in range(blocks + 1)]
    outs = [cast(tuple, _attend(q[..., start:stop, :], k[..., :stop, :], v[..., :stop, :],
                                bias[..., start:stop, :stop]))[0] for start, stop in zip(edges, edges[1:])]
    return mx.concatenate(outs, axis=-2)


def _with_ones(x: mx.array) -> mx.array:
    return mx.concatenate([x, mx.ones(x.shape[:-1] + (1,), dtype=x.dtype)], axis=-1)


@_attend.vjp
def _attend_vjp(primals, cotangents, outputs):
    """With P = E / l and dO the output's cotangent: dV = P^T dO, dP = dO V^T, dS = P (dP - rowsum(dO O))
    (rowsum(dP P) = rowsum(dO O): T x D, not T x T), dQ = dS K, dK = dS^T Q. The 1 / l goes onto dO first, and
    the row term into the dP matmul, as a column of dO against a column of ones beside V."""
    q, k, v, bias = primals
    out, e, rows = outputs
    d_out = cotangents[0] / rows
    d_v = e.swapaxes(-1, -2) @ d_out
    row_term = (d_out * out).sum(axis=-1, keepdims=True)
    d_scores = e * (mx.concatenate([d_out, -row_term], axis=-1) @ _with_ones(v).swapaxes(-1, -2))
    d_q, d_k = d_scores @ k, d_scores.swapaxes(-1, -2) @ q
    if d_k.shape != k.shape:  # grouped-query: k and v were broadcast over the query heads of their group
        d_k, d_v = d_k.sum(axis=2, keepdims=True), d_v.sum(axis=2, keepdims=True)
    return d_q, d_k, d_v, mx.broadcast_to(mx.array(0.0, dtype=bias.dtype), bias.shape)  # no T x T write

