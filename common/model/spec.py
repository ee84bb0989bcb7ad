"""The Llama architecture both backends build, and its presets.

Parameter names follow Hugging Face `LlamaForCausalLM`, so one safetensors file loads into MLX, torch
and transformers alike. The fields beyond the presets' (an explicit head size, rope scaling, biases) exist for
pretrained checkpoints (common/model/hfconfig.py reads and writes their config.json); their defaults are what the
presets have always computed, so a preset's seed weights and numbers do not change.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Iterable

from common.errors import UserError
from common.model.rope import check_scaling


@dataclass(frozen=True)
class ModelSpec:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    attention_head_dim: int = 0       # 0: dim / n_heads; else HF's head_dim where it differs from that
    # HF's rope_scaling as sorted (key, value) pairs: frozen and hashable (common/model/rope.py); () = plain RoPE.
    rope_scaling: tuple | dict = ()  # a dict (config.json, TOML) becomes pairs in __post_init__
    attention_bias: bool = False      # q, k, v and o projections with a bias (HF attention_bias)
    mlp_bias: bool = False            # gate, up and down projections with a bias (HF mlp_bias)

    def __post_init__(self):
        object.__setattr__(self, "rope_scaling", _scaling_pairs(self.rope_scaling))
        if self.rope_scaling:
            check_scaling(dict(self.rope_scaling))
        if not isinstance(self.attention_head_dim, int) or isinstance(self.attention_head_dim, bool) \
                or self.attention_head_dim < 0:
            raise UserError(f"model.attention_head_dim must be 0 (dim / n_heads) or a positive integer, "
                            f"got {self.attention_head_dim!r}")
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise UserError(f"model.{name} must be a positive integer, got {value!r}")
        if not self.rope_theta > 0:
            raise UserError(f"model.rope_theta must be positive, got {self.rope_theta!r}")
        if not self.norm_eps > 0:
            raise UserError(f"model.norm_eps must be positive, got {self.norm_eps!r}")
        if self.dim % self.n_heads and not self.attention_head_dim:
            raise UserError(f"model.dim ({self.dim}) must be divisible by model.n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise UserError(
                f"model.n_heads ({self.n_heads}) must be divisible by model.n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise UserError(f"model head_dim = {self.head_dim} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.dim // self.n_heads

    def with_(self, **changes) -> "ModelSpec":
        return replace(self, **changes)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["rope_scaling"] = dict(self.rope_scaling)  # JSON and TOML write a table, not pairs
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "ModelSpec":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise UserError(f"unknown model field {unknown[0]!r}; allowed: {', '.join(sorted(known))}")
        return cls(**data)


def _scaling_pairs(value) -> tuple:
    """rope_scaling as sorted (key, value) pairs, from a dict (config.json, TOML) or pairs (a frozen spec)."""
    if value is None:
        return ()
    items: Iterable
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in value):
        items = value
    else:
        raise UserError(f"model.rope_scaling must be a table such as {{rope_type = \"linear\", factor = 2.0}}, "
                        f"got {value!r}")
    # Numbers as floats, except the one length, so equal settings compare (and hash) equal however written.
    return tuple(sorted((str(k), v if isinstance(v, (str, bool)) or k == "original_max_position_embeddings"
                         else float(v) if isinstance(v, (int, float)) else v) for k, v in items))


# `vocab_size` of a preset is a default: the run's tokenizer decides it unless the user sets it.
PRESETS: dict[str, ModelSpec] = {
    # Tests and the demo: a training step takes milliseconds on one core.
    "tiny": ModelSpec(vocab_size=2048, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176,
                      max_seq_len=512),
    # The MLX blog's model (TinyStories + GPT-2 tokenizer).
    "small": ModelSpec(vocab_size=50257, dim=256, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=512,
                       max_seq_len=1024),
    # The PyTorch DDP article's model, with grouped-query attention.
    "base": ModelSpec(vocab_size=50000, dim=768, n_layers=12, n_heads=12, n_kv_heads=3, ffn_dim=3072,
                      max_seq_len=2048),
}


def preset(name: str) -> ModelSpec:
    if name not in PRESETS:
        raise UserError(f"unknown preset {name!r}; allowed: {', '.join(PRESETS)}")
    return PRESETS[name]
