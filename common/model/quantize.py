"""The frozen base's storage: float32 (`FullPrecision`), or MLX's affine quantization (`Quantization`, QLoRA:
`--quantize-base 4|8 --quantize-group-size 64`). One object per choice, asked by the inputs (the quantized seed),
the checks, the cost model and both frameworks (mlx_impl/quantized.py, torch_impl/quantized.py), so no Trainer
asks "is the base quantized?".

MLX's affine quantization, as `mx.quantize` computes it (this numpy copy is bit for bit equal to mx.quantize in
MLX 0.32, tests/unit/test_quantize.py): every `group_size` consecutive weights of a row share a scale s and a bias
b, and each weight is stored as q in [0, 2^bits - 1] with w ~ s * q + b; the q of a row are packed into uint32
words, lowest bits first. The layout is mlx-lm's (`mlx_lm.convert -q`): `X.weight` (out, in * bits / 32) uint32,
`X.scales` and `X.biases` (out, in / group_size), and config.json's `quantization: {group_size, bits}`. Which
modules: every Linear and the embedding whose input side is a multiple of the group size (mlx-lm's rule); the
rest, and the norms, stay float32. Both frameworks compute on exactly the dequantized values s * q + b.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.errors import UserError
from common.model.spec import ModelSpec
from common.model.weights import parameter_shapes

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)  # what MLX's quantized matmul accepts
# The float32 bytes a product dequantizes at a time: the 1B shape's 4-bit peak RSS fell from 8.7 GB (MLX) and 6.3
# (torch) with whole matrices (benchmarks/bench_lora_1b.py); a block still fills the BLAS (512 x 2048 x 4096).
BLOCK_BYTES = 32 * 2**20


@dataclass(frozen=True)
class FullPrecision:
    """An unquantized float32 base: every tensor as parameter_shapes says."""
    bits = 32

    def modules(self, spec: ModelSpec) -> list[str]:
        return []

    def base_shapes(self, spec: ModelSpec) -> dict[str, tuple[int, ...]]:
        return parameter_shapes(spec)

    def base_bytes(self, spec: ModelSpec) -> int:
        return sum(math.prod(s) * 4 for s in parameter_shapes(spec).values())

    def describe(self) -> dict | None:
        return None


@dataclass(frozen=True)
class Quantization:
    """The base's Linears and embedding stored in `bits` bits, groups of `group_size` sharing a scale and bias."""
    bits: int = 4
    group_size: int = 64

    def modules(self, spec: ModelSpec) -> list[str]:
        """The quantized modules' HF paths ("model.layers.0.self_attn.q_proj", "model.embed_tokens")."""
        return [name[:-len(".weight")] for name, shape in parameter_shapes(spec).items()
                if len(shape) == 2 and shape[1] % self.group_size == 0]

    def shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """{weight, scales, biases} of one quantized (out, in) matrix."""
        out_features, in_features = shape
        return {"weight": (out_features, in_features * self.bits // 32),
                "scales": (out_features, in_features // self.group_size),
                "biases": (out_features, in_features // self.group_size)}

    def base_shapes(self, spec: ModelSpec) -> dict[str, tuple[int, ...]]:
        """What a quantized base file holds, under HF names: each quantized module's three tensors."""
        shapes = dict(parameter_shapes(spec))
        for module in self.modules(spec):
            matrix = shapes.pop(module + ".weight")
            shapes.update({f"{module}.{part}": s for part, s in self.shapes(matrix).items()})
        return shapes

    def base_bytes(self, spec: ModelSpec) -> int:
        """Bytes of the base as both frameworks hold it: packed words, float32 scales and biases, float32 rest."""
        return sum(math.prod(s) * 4 for s in self.base_shapes(spec).values())  # uint32 and float32: 4 bytes

    def row_blocks(self, out_features: int, in_features: int) -> list[tuple[int, int]]:
        """The rows a product dequantizes at a time (both frameworks): a block's float32 matrix at most BLOCK_BYTES,
        so that a rank never holds a large matrix dequantized whole (the tied head of a 128k vocabulary: 1 GB)."""
        rows = max(1, BLOCK_BYTES // (4 * in_features))
        return [(start, min(start + rows, out_features)) for start in range(0, out_features, rows)]

    def describe(self) -> dict:
        """config.json's `quantization` section (mlx-lm's), and summary.json's."""
        return {"group_size": self.group_size, "bits": self.bits, "mode": "affine"}

    def quantize(self, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(packed uint32, scales, biases) of a float32 (out, in) matrix, as mx.quantize computes them: the edge of
        larger magnitude (max or min) is represented exactly, so a group's zero stays near a code."""
        out_features, in_features = w.shape
        g = np.asarray(w, np.float32).reshape(out_features, in_features // self.group_size, self.group_size)
        w_max, w_min = g.max(-1, keepdims=True), g.min(-1, keepdims=True)
        n_bins = np.float32(2 ** self.bits - 1)
        negative_edge = np.abs(w_min) > np.abs(w_max)
        scales = np.maximum((w_max - w_min) / n_bins, np.float32(1e-7)).astype(np.float32)
        scales = np.where(negative_edge, scales, -scales)
        edge = np.where(negative_edge, w_min, w_max)
        q0 = np.round(edge / scales)
        with np.errstate(divide="ignore", invalid="ignore"):
            scales = np.where(q0 != 0, edge / q0, scales).astype(np.float32)
        biases = np.where(q0 == 0, np.float32(0), edge).astype(np.float32)
        q = np.clip(np.round((g - biases) / scales), 0, n_bins).astype(np.uint32)
        return self.pack(q.reshape(out_features, in_features)), scales[..., 0], biases[..., 0]

    def pack(self, q: np.ndarray) -> np.ndarray:
        per_word = 32 // self.bits
        q = q.reshape(q.shape[0], -1, per_word).astype(np.uint32)
        packed = np.zeros(q.shape[:2], np.uint32)
        for j in range(per_word):
            packed |= q[..., j] << np.uint32(self.bits * j)
        return packed

    def unpack(self, packed: np.ndarray) -> np.ndarray:
        per_word = 32 // self.bits
        words = np.asarray(packed).view(np.uint32)
        codes = [(words >> np.uint32(self.bits * j)) & np.uint32(2 ** self.bits - 1) for j in range(per_word)]
        return np.stack(codes, axis=-1).reshape(words.shape[0], -1)

    def dequantize(self, packed: np.ndarray, scales: np.ndarray, biases: np.ndarray) -> np.ndarray:
        """The float32 values both frameworks compute on: s * q + b, per group."""
        q = self.unpack(packed).astype(np.float32)
        rows, cols = q.shape
        q = q.reshape(rows, cols // self.group_size, self.group_size)
        s = np.asarray(scales, np.float32)[..., None]
        b = np.asarray(biases, np.float32)[..., None]
        return (q * s + b).reshape(rows, cols)


BaseStorage = FullPrecision | Quantization


def base_storage_of(bits: int, group_size: int) -> BaseStorage:
    """RunConfig's choice as its object: FullPrecision at 0 bits."""
    if not bits:
        return FullPrecision()
    if bits not in BITS:
        raise UserError(f"--quantize-base {bits}: allowed: {', '.join(map(str, BITS))} bits")
    if group_size not in GROUP_SIZES:
        raise UserError(f"--quantize-group-size {group_size}: allowed: {', '.join(map(str, GROUP_SIZES))}")
    return Quantization(bits=bits, group_size=group_size)


def quantized_bytes(shape: tuple[int, ...], bits: int, group_size: int) -> int:
    """Bytes of one (out, in) matrix stored quantized (packed words, float32 scales and biases): the cost model's."""
    return sum(math.prod(s) * 4 for s in Quantization(bits, group_size).shapes(tuple(shape)).values())


def folder_quantization(folder: Path) -> Quantization | None:
    """The `quantization` section of a folder's config.json (mlx_lm.convert -q writes it), or None."""
    config_path = Path(folder) / "config.json"
    try:
        section = json.loads(config_path.read_text()).get("quantization")
    except (OSError, json.JSONDecodeError):
        return None  # the folder's own checks (common/model/weights.py) say what is wrong with it
    if not section:
        return None
    mode = section.get("mode", "affine")
    if mode != "affine":
        raise UserError(f"{config_path}: quantization mode {mode!r} is not read; only MLX's affine quantization")
    try:
        return Quantization(bits=int(section["bits"]), group_size=int(section["group_size"]))
    except (KeyError, TypeError, ValueError):
        raise UserError(f"{config_path}: its quantization section needs integer bits and group_size") from None


def quantize_tensors(storage: Quantization, spec: ModelSpec, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A float32 base's tensors (HF names) with every quantized module's weight replaced by its three tensors."""
    out = {}
    quantized = set(storage.modules(spec))
    for name, value in tensors.items():
        module = name[:-len(".weight")]
        if name.endswith(".weight") and module in quantized:
            packed, scales, biases = storage.quantize(value)
            out.update({name: packed, module + ".scales": scales, module + ".biases": biases})
        else:
            out[name] = value
    return out


def quantized_seed(source: Path, spec: ModelSpec, storage: Quantization, cache_dir: Path) -> Path:
    """A float32 folder's base quantized, in mlx-lm's layout (config.json with `quantization`, model.safetensors
    with each quantized module's three tensors): written once per (file, size, mtime, quantization) into the
    cache and shared by every run and framework, as the seed checkpoint is (compare/launch/runner.py)."""
    import hashlib
    import os
    import shutil

    from safetensors.numpy import save_file

    from common.fsutil import atomic_write_bytes
    from common.model.weights import load_pretrained

    weights = (Path(source) / "model.safetensors").resolve()
    stat = weights.stat()
    key = hashlib.sha256(json.dumps([str(weights), stat.st_size, stat.st_mtime_ns, storage.describe()])
                         .encode()).hexdigest()[:16]
    final = Path(cache_dir) / "seeds" / f"q{storage.bits}g{storage.group_size}-{key}"
    if (final / "model.safetensors").exists() and (final / "config.json").exists():
        return final
    tmp = final.with_name(f".{final.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    _, tensors = load_pretrained(Path(source))
    save_file({k: np.ascontiguousarray(v) for k, v in quantize_tensors(storage, spec, tensors).items()},
              str(tmp / "model.safetensors"), metadata={"format": "mlx"})
    config = json.loads((Path(source) / "config.json").read_text())
    config["quantization"] = config["quantization_config"] = storage.describe()  # as mlx_lm.convert writes both
    atomic_write_bytes(tmp / "config.json", json.dumps(config, indent=2).encode())
    try:
        os.replace(tmp, final)
    except OSError:  # another process won the race; its copy is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return final


class DequantizedSource:
    """A quantized base file read as the float32 HF tensors it stands for, s * q + b (a TensorSource: what the
    exports hand to tools that do not read MLX's layout, transformers and peft)."""

    def __init__(self, source, storage: Quantization, spec: ModelSpec):
        self.source, self.storage, self.bytes_read = source, storage, 0
        self.quantized = set(storage.modules(spec))
        held = set(source.names())
        self._shapes = {name: shape for name, shape in parameter_shapes(spec).items()
                        if name in held or name.removesuffix(".weight") in self.quantized}

    def names(self) -> list[str]:
        return list(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def read(self, name: str, index: tuple = ()) -> np.ndarray:
        module = name.removesuffix(".weight")
        if module in self.quantized:
            out = self.storage.dequantize(*(self.source.read(f"{module}.{part}")
                                            for part in ("weight", "scales", "biases")))[index]
        else:
            out = self.source.read(name, index)
        self.bytes_read += out.nbytes
        return out
