"""The kernels MLX's model computes with where the choice depends on the machine: its exp (--mlx-exp), the route
of its bfloat16 matmuls on a CPU (--mlx-bf16-matmul), and the row max and softmax written out for mx.compile.
Mirrors torch_impl/kernels.py name for name. mlx_impl/model.py and mlx_impl/attention.py compute with them;
kernel_choice.py times them.
"""
from __future__ import annotations

import functools

import mlx.core as mx

from . import fast_exp

EXP_KINDS = ("native", "fused")
_EXP = {"kind": "native"}


def set_exp(kind: str) -> None:
    """The exp that softmax, cross-entropy and SiLU trace from now on: "native" (mx.exp) or "fused"
    (mlx_impl/fast_exp.py, --mlx-exp). The Trainer sets it before it compiles its step: a compiled function
    keeps the graph it traced, so a change reaches only what is traced after it."""
    if kind not in EXP_KINDS:
        raise ValueError(f"unknown exp {kind!r}; allowed: {', '.join(EXP_KINDS)}")
    _EXP["kind"] = kind


BF16_MATMUL_KINDS = ("native", "fp32")
_BF16_MATMUL = {"kind": "native"}


def set_bf16_matmul(kind: str) -> None:
    """How bfloat16 matmuls on a CPU compute from now on (--mlx-bf16-matmul; traced, as set_exp): "native"
    (MLX's own bf16 kernel) or "fp32" (`matmul`'s route through the BLAS's sgemm)."""
    if kind not in BF16_MATMUL_KINDS:
        raise ValueError(f"unknown bf16 matmul {kind!r}; allowed: {', '.join(BF16_MATMUL_KINDS)}")
    _BF16_MATMUL["kind"] = kind


def matmul(a: mx.array, b: mx.array, bf16_kind: str | None = None) -> mx.array:
    """a @ b. With bfloat16 operands on a CPU under --mlx-bf16-matmul fp32: both upcast to float32 (exact), one
    float32 matmul (the preloaded OpenBLAS's sgemm, 20x MLX's own bf16 kernel, which reaches no BLAS), the result
    rounded once to bfloat16. Both accumulate in float32 and round once, so the values are the bf16 kernel's
    (docs/precision.md); so are the gradients: the vjp of the casts rounds each once to bfloat16. Metal and CUDA
    keep MLX's own kernel."""
    if a.dtype == b.dtype == mx.bfloat16 and (bf16_kind or _BF16_MATMUL["kind"]) == "fp32" \
            and mx.default_device() == mx.cpu:
        return (a.astype(mx.float32) @ b.astype(mx.float32)).astype(mx.bfloat16)
    return a @ b


def _exp_minus(x: mx.array, shift: mx.array, kind: str | None = None) -> mx.array:
    """exp(x - shift); shift (a row max) gets no gradient, as it cancels wherever this is used."""
    if (kind or _EXP["kind"]) == "fused" and x.dtype == mx.float32:
        return fast_exp.exp_minus(x, shift)
    return mx.exp(x - mx.stop_gradient(shift))


def _exp(x: mx.array, kind: str | None = None) -> mx.array:
    """exp(x): the fused one, where chosen, for float32."""
    if (kind or _EXP["kind"]) == "fused" and x.dtype == mx.float32:
        return fast_exp.exp(x)
    return mx.exp(x)


def _exp_negated(x: mx.array) -> mx.array:
    if _EXP["kind"] == "fused" and x.dtype == mx.float32:
        return fast_exp.exp_negated(x)
    return mx.exp(-x)


def _softmax(scores: mx.array, exp_kind: str) -> mx.array:
    """Softmax over the last axis in float32, rounded once to the scores' dtype. Written out so that mx.compile
    fuses the subtraction and exp into one kernel built for this CPU (--mlx-cpu-jit; MLX's softmax and exp
    primitives are prebuilt for baseline x86-64); the max is a constant shift, no gradient flows to it."""
    s = scores.astype(mx.float32)
    e = _exp(s - mx.stop_gradient(_row_max(s)), exp_kind)  # shift first: fast_exp.exp says why
    return (e / e.sum(axis=-1, keepdims=True)).astype(scores.dtype)


def _row_max(x: mx.array) -> mx.array:
    """x.max(axis=-1, keepdims=True), the same values: the row halved by elementwise maximums down to 8 columns (an
    odd column out is kept aside as a running maximum), which mx.compile fuses into one vectorised kernel, then
    MLX's max over what is left. MLX's own CPU max reduction runs at half its sum's speed: 0.46 -> 0.25 ms over the
    demo's attention scores, 2.26 -> 0.94 over `small`'s (Intel Xeon VM, docs/notes/2026-11-attention-cpu.md)."""
    aside = None
    while x.shape[-1] > 8:
        half = x.shape[-1] // 2
        if x.shape[-1] % 2:
            last = x[..., -1:]
            aside = last if aside is None else mx.maximum(aside, last)
        x = mx.maximum(x[..., :half], x[..., half:2 * half])
    peak = x.max(axis=-1, keepdims=True)
    return peak if aside is None else mx.maximum(peak, aside)


# One compiled softmax per exp: a compiled function keeps the graph it first traced.
_SOFTMAX = {kind: mx.compile(functools.partial(_softmax, exp_kind=kind)) for kind in EXP_KINDS}
