"""Seed weights: generated once in numpy from a seed, saved as safetensors, loaded by both backends.

Equal seeds in two frameworks' RNGs do not give equal weights; this file is how runs become comparable.

Init scheme (GPT-2 / HF Llama style, all float32):
- every Linear and the embedding: normal(0, 0.02);
- the projections that write into the residual stream (o_proj, down_proj): normal(0, 0.02 / sqrt(2 * n_layers));
- RMSNorm weights: ones; biases (attention_bias, mlp_bias): zeros.
Tensors are drawn in `parameter_shapes` order from one `numpy.random.Generator(PCG64(seed))`, so the
same seed and spec always give the same bytes.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from common.errors import UserError
from common.model.hfconfig import from_hf_config, to_hf_config
from common.model.spec import ModelSpec

INIT_STD = 0.02


def parameter_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """HF Llama parameter names and shapes, in a fixed order (a bias right after its weight, where the spec
    has biases, so the order of the presets' tensors, and so their seed bytes, never change)."""
    d, q, kv = spec.dim, spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, d)}

    def linear(name: str, out_features: int, in_features: int, bias: bool) -> None:
        shapes[name + ".weight"] = (out_features, in_features)
        if bias:
            shapes[name + ".bias"] = (out_features,)

    for i in range(spec.n_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (d,)
        for name, out_features, in_features in (("q_proj", q, d), ("k_proj", kv, d), ("v_proj", kv, d),
                                                ("o_proj", d, q)):
            linear(p + "self_attn." + name, out_features, in_features, spec.attention_bias)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
        for name, out_features, in_features in (("gate_proj", spec.ffn_dim, d), ("up_proj", spec.ffn_dim, d),
                                                ("down_proj", d, spec.ffn_dim)):
            linear(p + "mlp." + name, out_features, in_features, spec.mlp_bias)
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
        elif name.endswith(".bias"):  # zeros, as transformers initialises a Linear's bias; draws nothing
            weights[name] = np.zeros(shape, dtype=np.float32)
        else:
            std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else INIT_STD
            weights[name] = (rng.standard_normal(shape, dtype=np.float32) * np.float32(std))
    return weights


def save_pretrained(directory: Path, spec: ModelSpec, weights: dict[str, np.ndarray]) -> None:
    """Write an HF-format directory (config.json + model.safetensors), atomically per file."""
    from safetensors.numpy import save_file

    from common.fsutil import atomic_write_bytes, atomic_path

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with atomic_path(directory / "model.safetensors") as tmp:
        save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, str(tmp),
                  metadata={"format": "pt"})
    atomic_write_bytes(directory / "config.json",
                       json.dumps(to_hf_config(spec), indent=2).encode())


def load_pretrained(directory: Path) -> tuple[ModelSpec, dict[str, np.ndarray]]:
    """Read an HF-format Llama directory; checks every tensor's name and shape against the spec."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    directory = Path(directory)
    config_path, weights_path = directory / "config.json", directory / "model.safetensors"
    from common.checkpoint.sharded import ShardedSource, is_sharded

    if is_sharded(directory) and not weights_path.exists():  # a --checkpoint-format sharded checkpoint
        weights_path = directory / "shards"
    for path in (config_path, weights_path):
        if not path.exists():
            raise UserError(f"{path} not found: expected an HF-format Llama directory")
    try:
        spec = from_hf_config(json.loads(config_path.read_text()))
    except json.JSONDecodeError as err:
        raise UserError(f"{config_path} is not valid JSON: {err}") from None
    try:
        if weights_path.is_dir():  # tensorsource.read_all's one line: tensorsource imports this module
            shards = ShardedSource(directory)
            weights = {name: shards.read(name) for name in shards.names()}
        else:
            weights = load_file(str(weights_path))
    except (SafetensorError, OSError, ValueError) as err:
        raise UserError(f"{weights_path} cannot be read (truncated or corrupt?): {err}") from None
    check_weights(spec, weights, str(weights_path))
    return spec, {k: v.astype(np.float32, copy=False) for k, v in weights.items()}


def check_weights(spec: ModelSpec, weights: dict[str, np.ndarray], where: str,
                  expected: dict[str, tuple[int, ...]] | None = None) -> None:
    """Every tensor of parameter_shapes(spec) (or of `expected`), no other, each of its shape."""
    expected = parameter_shapes(spec) if expected is None else expected
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


def weights_digest(directory: Path, cache_dir: Path) -> str:
    """sha256 of a folder's model.safetensors: what names the starting checkpoint in summary.json. Remembered
    in cache_dir by path, size and mtime, since a real checkpoint takes seconds to hash and every run asks."""
    import hashlib

    from common.fsutil import atomic_write_text

    path = (Path(directory) / "model.safetensors").resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:24]
    remembered = Path(cache_dir) / "digests" / key
    if remembered.is_file():
        return remembered.read_text().strip()
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    remembered.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(remembered, digest.hexdigest())
    return digest.hexdigest()
