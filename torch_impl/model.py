"""Llama in PyTorch, numerically equal to transformers' LlamaForCausalLM in float32.

Mirrors mlx_impl/model.py name for name: a diff between the two shows only framework differences.
Parameter names are Hugging Face's, so a seed checkpoint loads here, in MLX and in transformers.
Mixed precision (common/model/precision.py) is written as explicit casts: the parameters stay float32, the
embedding output is cast to the compute dtype, and every parameter is cast to its input's dtype at use.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from common.model.rope import spec_tables
from common.model.spec import ModelSpec
from common.model.weights import load_pretrained

from .kernels import BF16_MATMUL_KINDS, EXP_KINDS, matmul, set_bf16_matmul, set_exp  # noqa: F401
from .attention import ATTENTION_BLOCKS, attention, attention_mask, set_attention  # noqa: F401
from .lora import adapted


CROSS_ENTROPY_KINDS = ("native", "shift", "tree", "tree_shift")


def set_cross_entropy(kind: str) -> None:
    """MLX's twin picks how its written-out cross-entropy shifts the logits (a timed choice); torch's
    F.cross_entropy is one fused kernel, so every kind runs it."""
    if kind not in CROSS_ENTROPY_KINDS:
        raise ValueError(f"unknown cross-entropy {kind!r}; allowed: {', '.join(CROSS_ENTROPY_KINDS)}")


class RoPE(nn.Module):
    """HF's rotate-half rotary embedding (pairs i and i + head_dim/2), from common/model/rope.py's float32 tables:
    the same numbers mlx_impl/model.py uses, whatever the rope scaling. traditional=True rotates pairs
    (2i, 2i + 1) instead (MLX's and GPT-J's layout): only the planted bug of `diagnose` sets it."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec, self.traditional = spec, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin = _rope_tensors(self.spec, x.shape[-2], x.device)
        # In x's dtype, tables rounded to it, as HF's apply_rotary_pos_emb does.
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        if self.traditional:
            half = x.shape[-1] // 2
            even, odd = x[..., 0::2], x[..., 1::2]
            c, s = cos[:, :half], sin[:, :half]
            return torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin


_ROPE_CACHE: dict = {}


def _rope_tensors(spec: ModelSpec, T: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The (T, head_dim) tables as tensors, made once per spec, length and device (every layer shares them;
    not buffers, so never in a state_dict or checkpoint)."""
    key = (spec, T, str(device))
    if key not in _ROPE_CACHE:
        if len(_ROPE_CACHE) >= 32:  # sampling grows T token by token: keep a bound
            _ROPE_CACHE.clear()
        _ROPE_CACHE[key] = tuple(torch.from_numpy(t.copy()).to(device) for t in spec_tables(spec, T))
    return _ROPE_CACHE[key]


class Linear(nn.Linear):
    """The float32 weight (and bias, where the spec has one) is cast to the input's dtype at use, so its
    gradient lands in float32; so are LoRA's adapters where lora.py attached them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        return adapted(self, x, y)  # LoRA's term where lora.py attached adapters


class Embedding(nn.Embedding):
    """The lookup stays float32 (LlamaModel casts its output); as the tied output head, cast at use."""

    def reset_parameters(self) -> None:
        # On the meta device (where every rank builds its model: step.py) there is nothing to draw, and normal_
        # there runs torch's Python reference, whose wrapper imports torch._dynamo: 1 s of a torch rank's start.
        if not self.weight.is_meta:
            super().reset_parameters()

    def as_linear(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype))


class RMSNorm(nn.RMSNorm):
    """HF Llama's: statistics in float32, rounded once to the input's dtype, then times the weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), self.normalized_shape, None, self.eps).to(x.dtype)
        return normed * self.weight.to(x.dtype)


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

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, -1).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, -1).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, -1).transpose(1, 2)
        q, k = self.rope(q), self.rope(k)
        # Grouped-query attention: each k/v head is shared among n_heads / n_kv_heads queries.
        # bf16 q, k, v: the CPU kernel keeps q.k scores in float32, softmax accumulates in float32.
        out = attention(q, k, v, self.scale, mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.gate_proj = Linear(spec.dim, spec.ffn_dim, bias=spec.mlp_bias)
        self.up_proj = Linear(spec.dim, spec.ffn_dim, bias=spec.mlp_bias)
        self.down_proj = Linear(spec.ffn_dim, spec.dim, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_gate(self.gate_proj(x), self.up_proj(x)))


def silu_gate(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The MLP's activation, SiLU(gate) * up (its own function so that the op-class profile, opclasses.py,
    times the model's own code). SiLU in float32, rounded once: what torch's bf16 kernel does; MLX's would round
    the sigmoid first."""
    return F.silu(gate.float()).to(gate.dtype) * up


class TransformerBlock(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.dim, eps=spec.norm_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.dim, eps=spec.norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, spec: ModelSpec, compute_dtype: str = "float32"):
        super().__init__()
        self.compute_dtype = getattr(torch, compute_dtype)
        self.embed_tokens = Embedding(spec.vocab_size, spec.dim)
        self.layers = nn.ModuleList(TransformerBlock(spec) for _ in range(spec.n_layers))
        self.norm = RMSNorm(spec.dim, eps=spec.norm_eps)

    def forward(self, tokens: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed_tokens(tokens).to(self.compute_dtype)  # the residual stream's dtype
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

    def forward(self, tokens: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """int tokens (B, T) -> logits (B, T, vocab) in the compute dtype; padding_mask (B, T) is 1 for real tokens."""
        h = self.model(tokens, padding_mask)
        if self.spec.tie_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)


def token_loss_sum(model, inputs, targets, mask):
    """The sum of the masked token losses, in float64: a float32 sum of thousands of losses is off by
    ~1e-6 of the mean, as much as a real difference between world sizes. The gradients do not change:
    the float64 part only sums, and its gradient is cast back to float32 exactly."""
    losses = cross_entropy(model(inputs).float(), targets)
    wide = torch.float32 if losses.device.type == "mps" else torch.float64  # MPS has no float64
    return (losses.to(wide) * mask.reshape(-1)).sum()


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy, flattened. torch's log-softmax kernels are fused and vectorised already;
    mlx_impl/step.py writes its cross_entropy out so MLX's compiler can fuse it (and skip an exp pass)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")


def load_weights(model: Llama, weights: dict[str, np.ndarray]) -> None:
    """Set every parameter from an HF-named dict; raises on a missing, extra or misshapen tensor."""
    if model.spec.tie_embeddings:
        weights = {k: v for k, v in weights.items() if k != "lm_head.weight"}
    model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in weights.items()}, strict=True)


def weights_of(model: Llama) -> dict[str, np.ndarray]:
    return {k: v.detach().float().cpu().numpy().copy() for k, v in model.named_parameters()}


def from_pretrained(path: str | Path) -> Llama:
    spec, weights = load_pretrained(Path(path))
    model = Llama(spec)
    load_weights(model, weights)
    model.eval()
    return model
