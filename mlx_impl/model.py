"""Llama in MLX, numerically equal to transformers' LlamaForCausalLM in float32.

Mirrors torch_impl/model.py name for name: a diff between the two shows only framework differences.
Parameter names are Hugging Face's, so a seed checkpoint loads here, in torch and in transformers.
Mixed precision (common/model/precision.py) is written as explicit casts: the parameters stay float32, the
embedding output is cast to the compute dtype, and every parameter is cast to its input's dtype at use.
"""
from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from common.model.rope import spec_tables
from common.model.spec import ModelSpec
from common.model.weights import load_pretrained

from .attention import ATTENTION_BLOCKS, attention, attention_mask, set_attention  # noqa: F401
from .kernels import (BF16_MATMUL_KINDS, EXP_KINDS, _exp, _exp_minus, _exp_negated, _row_max,  # noqa: F401
                      matmul, set_bf16_matmul, set_exp)
from .lora import adapted

class Linear(nn.Linear):
    """The float32 weight (and bias, where the spec has one) is cast to the input's dtype at use, so its
    gradient lands in float32; so are LoRA's adapters where lora.py attached them."""

    def __call__(self, x: mx.array) -> mx.array:
        y = matmul(x, self.weight.astype(x.dtype).T)
        if "bias" in self:
            y = y + self.bias.astype(x.dtype)
        return adapted(self, x, y)  # LoRA's term where lora.py attached adapters


class Embedding(nn.Embedding):
    """The lookup stays float32 (LlamaModel casts its output); as the tied output head, cast at use."""

    def as_linear(self, x: mx.array) -> mx.array:
        return matmul(x, self.weight.astype(x.dtype).T)


class RMSNorm(nn.RMSNorm):
    """HF Llama's: statistics in float32, rounded once to the input's dtype, then times the weight."""

    def __call__(self, x: mx.array) -> mx.array:
        normed = mx.fast.rms_norm(x.astype(mx.float32), None, self.eps).astype(x.dtype)
        return normed * self.weight.astype(x.dtype)


class RoPE(nn.Module):
    """HF's rotate-half rotary embedding (pairs i and i + head_dim/2), from common/model/rope.py's float32 tables:
    the same numbers torch_impl/model.py uses, whatever the rope scaling. traditional=True rotates pairs
    (2i, 2i + 1) instead (MLX's and GPT-J's layout): only the planted bug of `diagnose` sets it."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec, self.traditional = spec, False

    def __call__(self, x: mx.array) -> mx.array:
        cos, sin = _rope_arrays(self.spec, x.shape[-2])
        # In x's dtype, tables rounded to it, as HF's apply_rotary_pos_emb does.
        cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
        if self.traditional:
            half = x.shape[-1] // 2
            even, odd = x[..., 0::2], x[..., 1::2]
            c, s = cos[:, :half], sin[:, :half]
            return mx.stack([even * c - odd * s, even * s + odd * c], axis=-1).reshape(x.shape)
        x1, x2 = mx.split(x, 2, axis=-1)
        return x * cos + mx.concatenate([-x2, x1], axis=-1) * sin


_ROPE_CACHE: dict = {}


def _rope_arrays(spec: ModelSpec, T: int) -> tuple[mx.array, mx.array]:
    """The (T, head_dim) tables as arrays, made once per spec and length (every layer shares them)."""
    key = (spec, T)
    if key not in _ROPE_CACHE:
        if len(_ROPE_CACHE) >= 32:  # sampling grows T token by token: keep a bound
            _ROPE_CACHE.clear()
        _ROPE_CACHE[key] = tuple(mx.array(t) for t in spec_tables(spec, T))
    return _ROPE_CACHE[key]


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.n_heads, self.n_kv_heads = spec.n_heads, spec.n_kv_heads
        self.scale = spec.head_dim ** -0.5
        bias = spec.attention_bias
        self.q_proj = Linear(spec.dim, spec.n_heads * spec.head_dim, bias=bias)
        self.k_proj = Linear(spec.dim, spec.n_kv_heads * spec.head_dim, bias=bias)
        self.v_proj = Linear(spec.dim, spec.n_kv_heads * spec.head_dim, bias=bias)
        self.o_proj = Linear(spec.n_heads * spec.head_dim, spec.dim, bias=bias)
        self.rope = RoPE(spec)

    def __call__(self, x: mx.array, mask: mx.array | str) -> mx.array:
        B, T, _ = x.shape
        q = self.q_proj(x).reshape(B, T, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, T, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, T, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q, k = self.rope(q), self.rope(k)
        # Grouped-query attention: each k/v head is shared among n_heads / n_kv_heads queries.
        # bf16 q, k, v: the CPU path rounds q.k scores to bf16, then softmax accumulates in float32.
        out = attention(q, k, v, self.scale, mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.gate_proj = Linear(spec.dim, spec.ffn_dim, bias=spec.mlp_bias)
        self.up_proj = Linear(spec.dim, spec.ffn_dim, bias=spec.mlp_bias)
        self.down_proj = Linear(spec.ffn_dim, spec.dim, bias=spec.mlp_bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(silu_gate(self.gate_proj(x), self.up_proj(x)))


def silu_gate(gate: mx.array, up: mx.array) -> mx.array:
    """The MLP's activation, SiLU(gate) * up (its own function so that the op-class profile, opclasses.py,
    times the model's own code). SiLU in float32, rounded once: what torch's bf16 kernel does; MLX's would round
    the sigmoid first. Written as torch's CPU kernel writes it, x / (1 + exp(-x)), so that mx.compile fuses it
    with its exp: nn.silu's sigmoid is a prebuilt kernel, 2x slower at tiny's shapes (issue 27)."""
    g = gate.astype(mx.float32)
    return (g / (1 + _exp_negated(g))).astype(gate.dtype) * up


class TransformerBlock(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.dim, eps=spec.norm_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.dim, eps=spec.norm_eps)
        self.mlp = MLP(spec)

    def __call__(self, x: mx.array, mask: mx.array | str) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, spec: ModelSpec, compute_dtype: str = "float32"):
        super().__init__()
        self.compute_dtype = getattr(mx, compute_dtype)
        self.embed_tokens = Embedding(spec.vocab_size, spec.dim)
        self.layers = [TransformerBlock(spec) for _ in range(spec.n_layers)]
        self.norm = RMSNorm(spec.dim, eps=spec.norm_eps)

    def __call__(self, tokens: mx.array, padding_mask: mx.array | None = None) -> mx.array:
        h = self.embed_tokens(tokens).astype(self.compute_dtype)  # the residual stream's dtype
        mask = attention_mask(padding_mask, tokens.shape[1])
        for layer in self.layers:
            h = layer(h, mask)
        return self.norm(h)


class Llama(nn.Module):
    def __init__(self, spec: ModelSpec, compute_dtype: str = "float32"):
        super().__init__()
        self.spec = spec
        self.model = LlamaModel(spec, compute_dtype)
        if not spec.tie_embeddings:
            self.lm_head = Linear(spec.dim, spec.vocab_size, bias=False)

    def __call__(self, tokens: mx.array, padding_mask: mx.array | None = None) -> mx.array:
        """int tokens (B, T) -> logits (B, T, vocab) in the compute dtype; padding_mask (B, T) is 1 for real tokens."""
        h = self.model(tokens, padding_mask)
        if self.spec.tie_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)


def token_loss_sum(model, inputs, targets, mask):
    """(float32 sum of the masked token losses, the masked token losses): the gradients come from the
    sum, the reported loss from the token losses (summed in float64 by `_exact_sum`)."""
    logits = model(inputs).astype(mx.float32)
    losses = cross_entropy(logits, targets) * mask
    return losses.sum(), losses


CROSS_ENTROPY_KINDS = ("native", "shift", "tree", "tree_shift")
_CROSS_ENTROPY = {"kind": "native"}


def set_cross_entropy(kind: str) -> None:
    """cross_entropy's shift from now on (traced, as set_exp; auto times them): MLX's row max inside the exp's
    kernels ("native"), subtracted first ("shift"), or the `_row_max` tree's ("tree", "tree_shift")."""
    if kind not in CROSS_ENTROPY_KINDS:
        raise ValueError(f"unknown cross-entropy {kind!r}; allowed: {', '.join(CROSS_ENTROPY_KINDS)}")
    _CROSS_ENTROPY["kind"] = kind


def cross_entropy(logits: mx.array, targets: mx.array) -> mx.array:
    """Per-token cross-entropy, logsumexp(logits) - logits[target], with the logsumexp written out.

    nn.losses.cross_entropy calls the LogSumExp primitive, whose gradient computes the softmax again: a
    second exponential of every logit, and on a CPU MLX's exp is the slowest part of the step (`small`:
    2048 x 50257 exponentials, ~1.3 s each; benchmarks/bench_ops.py). Written out, mx.compile fuses the
    subtraction and exp into one kernel and the backward reuses the forward's exponentials (the gradient of
    exp is its output). The max is a constant shift that cancels, so no gradient flows to it; the target
    logit is read from `logits`, not from the shifted array, which would then have to be materialised too."""
    return _cross_entropy(logits, targets, _CROSS_ENTROPY["kind"])


def _cross_entropy(logits: mx.array, targets: mx.array, kind: str, exp_kind: str | None = None) -> mx.array:
    """cross_entropy with the shift `kind` (set_cross_entropy) and the exp `exp_kind` (set_exp's, where None)."""
    peak = mx.stop_gradient(_row_max(logits) if kind.startswith("tree") else logits.max(axis=-1, keepdims=True))
    target_logits = mx.take_along_axis(logits, targets[..., None], axis=-1).squeeze(-1)
    e = _exp(logits - peak, exp_kind) if kind.endswith("shift") else _exp_minus(logits, peak, exp_kind)
    return mx.log(e.sum(axis=-1)) + peak.squeeze(-1) - target_logits


def load_weights(model: Llama, weights: dict[str, np.ndarray]) -> None:
    """Set every parameter from an HF-named dict; raises on a missing, extra or misshapen tensor."""
    if model.spec.tie_embeddings:
        weights = {k: v for k, v in weights.items() if k != "lm_head.weight"}
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()], strict=True)
    mx.eval(model.parameters())


def weights_of(model: Llama) -> dict[str, np.ndarray]:
    return {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(model.parameters())}


def from_pretrained(path: str | Path) -> Llama:
    spec, weights = load_pretrained(Path(path))
    model = Llama(spec)
    load_weights(model, weights)
    model.eval()
    return model
