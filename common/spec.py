"""The Llama architecture both backends build, and its presets.

Parameter names follow Hugging Face `LlamaForCausalLM`, so one safetensors file loads into MLX, torch
and transformers alike.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from .errors import UserError


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

    def __post_init__(self):
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise UserError(f"model.{name} must be a positive integer, got {value!r}")
        if not self.rope_theta > 0:
            raise UserError(f"model.rope_theta must be positive, got {self.rope_theta!r}")
        if not self.norm_eps > 0:
            raise UserError(f"model.norm_eps must be positive, got {self.norm_eps!r}")
        if self.dim % self.n_heads:
            raise UserError(f"model.dim ({self.dim}) must be divisible by model.n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise UserError(
                f"model.n_heads ({self.n_heads}) must be divisible by model.n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise UserError(f"model head_dim = dim / n_heads = {self.head_dim} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def with_(self, **changes) -> "ModelSpec":
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ModelSpec":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise UserError(f"unknown model field {unknown[0]!r}; allowed: {', '.join(sorted(known))}")
        return cls(**data)

    # Hugging Face config.json, so checkpoints open in transformers.
    def to_hf_config(self) -> dict:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "intermediate_size": self.ffn_dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_seq_len,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.norm_eps,
            "tie_word_embeddings": self.tie_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": "float32",
        }

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelSpec":
        try:
            n_heads = cfg["num_attention_heads"]
            rope_theta = cfg.get("rope_theta")
            if rope_theta is None:  # transformers >= 5 nests it under rope_parameters
                rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
            spec = cls(
                vocab_size=cfg["vocab_size"],
                dim=cfg["hidden_size"],
                n_layers=cfg["num_hidden_layers"],
                n_heads=n_heads,
                n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
                ffn_dim=cfg["intermediate_size"],
                max_seq_len=cfg.get("max_position_embeddings", 2048),
                rope_theta=float(rope_theta),
                norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
                tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            )
        except KeyError as missing:
            raise UserError(f"config.json lacks {missing.args[0]!r}; is it a Llama config?") from None
        if cfg.get("head_dim") not in (None, spec.head_dim):
            raise UserError(f"config.json head_dim {cfg['head_dim']} != hidden_size/num_attention_heads")
        return spec


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
