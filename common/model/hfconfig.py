"""A Hugging Face Llama config.json <-> ModelSpec: every field that changes the numbers is honoured or refused.

Honoured: the dimensions, head_dim (also where it differs from hidden_size / num_attention_heads),
max_position_embeddings, rms_norm_eps, tie_word_embeddings, attention_bias, mlp_bias, rope_theta and
rope_scaling of type default, linear, dynamic and llama3 (common/model/rope.py), in both layouts: transformers < 5
writes `rope_theta` and `rope_scaling` beside the other fields, transformers >= 5 nests them under
`rope_parameters`. Refused with a one-line UserError naming the field and its value: every other rope type
(yarn, longrope, ...), partial_rotary_factor, an activation other than SiLU, attention dropout, a model_type
other than llama. Fields that do not change a forward (ids of special tokens, dtype, initializer_range,
use_cache, pretraining_tp, which transformers >= 5 ignores) are read by nobody.

to_hf_config writes the older layout, which transformers 4 and 5 and mlx-lm all read, so an exported folder
reads back as the same spec (`from_hf_config(to_hf_config(s)) == s`).
"""
from __future__ import annotations

from common.errors import UserError
from common.model.spec import ModelSpec

DEFAULT_THETA = 10000.0


def to_hf_config(spec: ModelSpec) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.dim,
        "intermediate_size": spec.ffn_dim,
        "num_hidden_layers": spec.n_layers,
        "num_attention_heads": spec.n_heads,
        "num_key_value_heads": spec.n_kv_heads,
        "head_dim": spec.head_dim,
        "max_position_embeddings": spec.max_seq_len,
        "rope_theta": spec.rope_theta,
        "rope_scaling": dict(spec.rope_scaling) or None,
        "rms_norm_eps": spec.norm_eps,
        "tie_word_embeddings": spec.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": spec.attention_bias,
        "mlp_bias": spec.mlp_bias,
        "attention_dropout": 0.0,
        "torch_dtype": "float32",
    }


def from_hf_config(cfg: dict) -> ModelSpec:
    _refuse_unsupported(cfg)
    try:
        n_heads = cfg["num_attention_heads"]
        dim = cfg["hidden_size"]
        head_dim = cfg.get("head_dim") or (dim // n_heads if n_heads else 0)
        theta, scaling = rope_settings(cfg)
        max_positions = cfg.get("max_position_embeddings", 2048)
        if scaling.get("rope_type") == "llama3":  # transformers' default for an older config without it
            scaling.setdefault("original_max_position_embeddings", max_positions)
        return ModelSpec(
            vocab_size=cfg["vocab_size"],
            dim=dim,
            n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            ffn_dim=cfg["intermediate_size"],
            max_seq_len=max_positions,
            rope_theta=float(theta),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Stored only where it differs, so a config.json with the usual head_dim gives the preset's spec.
            attention_head_dim=0 if n_heads and head_dim * n_heads == dim else head_dim,
            rope_scaling=scaling if scaling.get("rope_type", "default") != "default" else (),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
        )
    except KeyError as missing:
        raise UserError(f"config.json lacks {missing.args[0]!r}; is it a Llama config?") from None


def rope_settings(cfg: dict) -> tuple[float, dict]:
    """(rope_theta, the scaling fields with rope_type) from either layout; rope_type "default" when unscaled."""
    nested = cfg.get("rope_parameters")
    if isinstance(nested, dict) and nested and not cfg.get("rope_scaling"):
        params = dict(nested)
        theta = params.pop("rope_theta", cfg.get("rope_theta") or DEFAULT_THETA)
    else:
        params = dict(cfg.get("rope_scaling") or {})
        theta = cfg.get("rope_theta") or (nested or {}).get("rope_theta") or DEFAULT_THETA
    if "type" in params:  # the spelling before rope_type
        params.setdefault("rope_type", params.pop("type"))
    params.setdefault("rope_type", "default")
    partial = params.pop("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise UserError(f"config.json partial_rotary_factor = {partial!r} is not implemented (RoPE over the "
                        "whole head only)")
    if params["rope_type"] == "default":
        extra = sorted(k for k in params if k != "rope_type")
        if extra:
            raise UserError(f"config.json rope field {extra[0]!r} = {params[extra[0]]!r} is not implemented "
                            "for rope_type 'default'")
    return theta, params


def _refuse_unsupported(cfg: dict) -> None:
    model_type = cfg.get("model_type", "llama")
    if model_type != "llama":
        raise UserError(f"config.json model_type = {model_type!r} is not implemented (only 'llama')")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UserError(f"config.json hidden_act = {act!r} is not implemented (only 'silu')")
    dropout = cfg.get("attention_dropout", 0.0) or 0.0
    if dropout:
        raise UserError(f"config.json attention_dropout = {dropout!r} is not implemented (training would draw "
                        "different dropout masks in each framework)")
