"""Rotary position embedding: the frequencies and the cos/sin tables both frameworks use.

Computed once here, in numpy, so MLX and torch cannot drift: each model turns the same float32 tables into
its own arrays (mlx_impl/model.py and torch_impl/model.py `RoPE`). The frequencies follow transformers'
ROPE_INIT_FUNCTIONS (modeling_rope_utils.py) for the types implemented here:
  default   inv_freq[i] = 1 / theta^(2i / head_dim)
  linear    inv_freq / factor
  llama3    Llama 3.1's smooth interpolation: low frequencies / factor, high ones kept, a ramp between
  dynamic   NTK: for a forward over T > max_position_embeddings tokens, theta grows to
            theta * (factor * T / max_pos - (factor - 1)) ^ (head_dim / (head_dim - 2)); up to max_pos it is
            the default. transformers computes this from the longest position of the forward and keeps the
            grown table for later, shorter calls (a cache); here every forward uses its own length, which is
            what transformers gives for one forward and for every training step at a fixed length.
The others (yarn, longrope, ...) are refused by name (common/model/hfconfig.py), not approximated.

The frequencies are computed in float32 operation by operation as transformers computes them (`_F32`), so
both frameworks hold transformers' very frequencies: at position 8192 an ulp of a frequency is 5e-4 rad. The
angles are float32(position) * inv_freq in float32, as transformers multiplies them, and cos/sin are rounded
once from float64.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from common.errors import UserError

# What each implemented type reads from rope_scaling, beside rope_type (all required, as transformers says).
SCALING_KEYS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def check_scaling(scaling: dict) -> None:
    """Refuse a rope_scaling this module does not compute exactly, naming the field and its value."""
    kind = scaling.get("rope_type")
    if kind not in SCALING_KEYS:
        raise UserError(f"rope_scaling rope_type {kind!r} is not implemented (implemented: default, "
                        f"{', '.join(SCALING_KEYS)}); training it would not compute the checkpoint's model")
    missing = [key for key in SCALING_KEYS[kind] if key not in scaling]
    if missing:
        raise UserError(f"rope_scaling of type {kind!r} lacks {missing[0]!r}")
    extra = sorted(set(scaling) - set(SCALING_KEYS[kind]) - {"rope_type"})
    if extra:
        raise UserError(f"rope_scaling field {extra[0]!r} = {scaling[extra[0]]!r} (type {kind!r}) is not "
                        "implemented")
    for key in SCALING_KEYS[kind]:
        value = scaling[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise UserError(f"rope_scaling {key} must be a positive number, got {value!r}")
    if kind == "llama3" and not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
        raise UserError("rope_scaling high_freq_factor must exceed low_freq_factor")
    if kind == "dynamic" and not scaling["factor"] >= 1:
        raise UserError(f"rope_scaling factor of type 'dynamic' must be >= 1, got {scaling['factor']!r}")


def inv_freq(head_dim: int, theta: float, scaling: dict | None, max_position_embeddings: int,
             seq_len: int) -> np.ndarray:
    """The head_dim / 2 inverse frequencies (float32) of a forward over seq_len positions, rounded as
    transformers rounds them (see `_F32`)."""
    scaling = scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "dynamic":  # python floats (double) in transformers too
        length = max(seq_len, max_position_embeddings)
        factor = float(scaling["factor"])
        theta = theta * ((factor * length / max_position_embeddings) - (factor - 1)) ** (head_dim / (head_dim - 2))
    exponents = _F32.div_scalar(np.arange(0, head_dim, 2).astype(np.float32), head_dim)
    freq = _F32.reciprocal(_F32.pow_scalar_base(theta, exponents))
    if kind == "linear":
        return _F32.div_scalar(freq, scaling["factor"])
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_context = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_context / low, old_context / high  # python floats, as transformers
        wavelen = _F32.scalar_div(2 * math.pi, freq)
        scaled = np.where(wavelen > low_wavelen, _F32.div_scalar(freq, factor), freq)
        smooth = _F32.div_scalar(_F32.scalar_div(old_context, wavelen) - np.float32(low), high - low)
        smoothed = _F32.div_scalar((np.float32(1) - smooth) * scaled, factor) + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    return freq


class _F32:
    """float32 arithmetic as torch's CPU kernels round it, so the frequencies equal transformers' bit for bit
    (measured on every entry for head_dim 16-128, theta 1e4-5e5, default and llama3; a float64 computation
    rounded once differs in up to a third of the entries by an ulp, which moves angles at position 8192 by
    5e-4 rad and logits by 9e-4). Sums, products and comparisons of float32 arrays are IEEE in both; torch
    divides by a python number as a multiplication by its float32 reciprocal, divides a python number by a
    tensor as that number times the tensor's reciprocal, and its float32 pow is correctly rounded here."""

    @staticmethod
    def div_scalar(x: np.ndarray, scalar: float) -> np.ndarray:
        return x / np.float32(scalar)

    @staticmethod
    def scalar_div(scalar: float, x: np.ndarray) -> np.ndarray:
        return np.float32(scalar) * (np.float32(1) / x)

    @staticmethod
    def reciprocal(x: np.ndarray) -> np.ndarray:
        return np.float32(1) / x

    @staticmethod
    def pow_scalar_base(base: float, exponents: np.ndarray) -> np.ndarray:
        return (np.float64(np.float32(base)) ** exponents.astype(np.float64)).astype(np.float32)


@lru_cache(maxsize=16)
def tables(head_dim: int, theta: float, scaling: tuple, max_position_embeddings: int,
           seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin), each (seq_len, head_dim) float32, in HF's rotate-half layout (the half repeated).
    `scaling` is ModelSpec.rope_scaling (sorted key-value pairs), hashable for the cache."""
    freq = inv_freq(head_dim, theta, dict(scaling), max_position_embeddings, seq_len)
    angles = np.arange(seq_len, dtype=np.float32)[:, None] * freq[None, :]  # float32 products, as transformers
    angles = np.concatenate([angles, angles], axis=1).astype(np.float64)
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    cos.flags.writeable = sin.flags.writeable = False  # shared by every caller through the cache
    return cos, sin


def spec_tables(spec, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """tables() of a ModelSpec."""
    return tables(spec.head_dim, float(spec.rope_theta), spec.rope_scaling, spec.max_seq_len, seq_len)
