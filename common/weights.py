"""Seed weights: generated once in numpy from a seed, saved as safetensors, loaded by both backends.

Equal seeds in two frameworks' RNGs do not give equal weights; this file is how runs become comparable.

Init scheme (GPT-2 / HF Llama style, all float32):
- every Linear and the embedding: normal(0, 0.02);
- the projections that write into the residual stream (o_proj, down_proj): normal(0, 0.02 / sqrt(2 * n_layers));
- RMSNorm weights: ones.
Tensors are drawn in `parameter_shapes` order from one `numpy.random.Generator(PCG64(seed))`, so the
same seed and spec always give the same bytes.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from .errors import UserError
from .spec import ModelSpec

INIT_STD = 0.02


def parameter_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """HF Llama parameter names and shapes, in a fixed order."""
    d, kv = spec.dim, spec.n_kv_heads * spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, d)}
    for i in range(spec.n_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (d, d),
            p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d),
            p + "self_attn.o_proj.weight": (d, d),
            p + "post_attention_layernorm.weight": (d,),
            p + "mlp.gate_proj.weight": (spec.ffn_dim, d),
            p + "mlp.up_proj.weight": (spec.ffn_dim, d),
            p + "mlp.down_proj.weight": (d, spec.ffn_dim),
        })
    shapes["model.norm.weight"] = (d,)
    if not spec.tie_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, d)
    return shapes


def num_parameters(spec: ModelSpec) -> int:
    return sum(math.prod(s) for s in parameter_shapes(spec).values())


def init_weights(spec: ModelSpec, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.Generator(np.random.PCG64(seed))
    residual_std = INIT_STD / math.sqrt(2 * spec.n_layers)
    weights = {}
    for name, shape in parameter_shapes(spec).items():
        if name.endswith("norm.weight"):
            weights[name] = np.ones(shape, dtype=np.float32)
        else:
            std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else INIT_STD
            weights[name] = (rng.standard_normal(shape, dtype=np.float32) * np.float32(std))
    return weights


def save_pretrained(directory: Path, spec: ModelSpec, weights: dict[str, np.ndarray]) -> None:
    """Write an HF-format directory (config.json + model.safetensors), atomically per file."""
    from safetensors.numpy import save_file

    from .fsutil import atomic_write_bytes, atomic_path

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with atomic_path(directory / "model.safetensors") as tmp:
        save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, str(tmp),
                  metadata={"format": "pt"})
    atomic_write_bytes(directory / "config.json",
                       json.dumps(spec.to_hf_config(), indent=2).encode())


def load_pretrained(directory: Path) -> tuple[ModelSpec, dict[str, np.ndarray]]:
    """Read an HF-format Llama directory; checks every tensor's name and shape against the spec."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    directory = Path(directory)
    config_path, weights_path = directory / "config.json", directory / "model.safetensors"
    from .shardedcheckpoint import ShardedSource, is_sharded
    from .tensorsource import read_all

    if is_sharded(directory) and not weights_path.exists():  # a --checkpoint-format sharded checkpoint
        weights_path = directory / "shards"
    for path in (config_path, weights_path):
        if not path.exists():
            raise UserError(f"{path} not found: expected an HF-format Llama directory")
    try:
        spec = ModelSpec.from_hf_config(json.loads(config_path.read_text()))
    except json.JSONDecodeError as err:
        raise UserError(f"{config_path} is not valid JSON: {err}") from None
    try:
        weights = (read_all(ShardedSource(directory)) if weights_path.is_dir() else load_file(str(weights_path)))
    except (SafetensorError, OSError, ValueError) as err:
        raise UserError(f"{weights_path} cannot be read (truncated or corrupt?): {err}") from None
    check_weights(spec, weights, str(weights_path))
    return spec, {k: v.astype(np.float32, copy=False) for k, v in weights.items()}


def check_weights(spec: ModelSpec, weights: dict[str, np.ndarray], where: str) -> None:
    expected = parameter_shapes(spec)
    weights = {k: v for k, v in weights.items() if not (spec.tie_embeddings and k == "lm_head.weight")}
    missing = [k for k in expected if k not in weights]
    if missing:
        raise UserError(f"{where}: missing tensor {missing[0]} ({len(missing)} missing) for this model spec")
    extra = [k for k in weights if k not in expected]
    if extra:
        raise UserError(f"{where}: unexpected tensor {extra[0]} for this model spec")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise UserError(f"{where}: {name} has shape {tuple(weights[name].shape)}, the spec needs {shape}")
