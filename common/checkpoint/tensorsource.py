"""Where a rank's starting tensors come from, read one tensor, or one slice of one, at a time.

A sharded strategy (fsdp, tp, pp) keeps only part of each tensor, so it must never hold the whole model
to start: it asks a `TensorSource` for the slices it keeps (`read(name, index)`), and the source reads
only those bytes (safetensors' `get_slice` maps the file and copies just the slice). The seed checkpoint,
a resumed checkpoint (whole HF files or the sharded format) and an in-memory dict all look the same to
the Trainer.

`bytes_read` counts what the rank copied out of the source, so a test can prove that a rank read its
share and not the whole model.
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

from common.errors import UserError

Index = tuple  # a tuple of slices, one per leading axis; () reads the whole tensor


class TensorSource(Protocol):
    bytes_read: int

    def names(self) -> list[str]:
        """Tensor names (HF names), in the file's order."""

    def shape(self, name: str) -> tuple[int, ...]:
        """The whole tensor's shape, without reading it."""

    def read(self, name: str, index: Index = ()) -> np.ndarray:
        """The tensor, or the slice `index` of it, as a float32 numpy array."""


def _as_float32(array: np.ndarray) -> np.ndarray:
    """Floats read as float32 (bf16 and fp16 exactly); a quantized base's packed uint32 words stay as they are."""
    return array if array.dtype in (np.float32, np.uint32) else array.astype(np.float32)


class DictSource:
    """Whole numpy arrays in memory (tests, diagnose, a state already gathered)."""

    def __init__(self, arrays: dict[str, np.ndarray]):
        self.arrays, self.bytes_read = arrays, 0

    def names(self) -> list[str]:
        return list(self.arrays)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.arrays[name].shape)

    def read(self, name: str, index: Index = ()) -> np.ndarray:
        out = _as_float32(np.ascontiguousarray(self.arrays[name][index]))
        self.bytes_read += out.nbytes
        return out


class SafetensorsSource:
    """One safetensors file, opened lazily; `prefix` selects and strips a name prefix ("exp_avg." of an
    optimizer file), so a checkpoint's moments read like its weights."""

    def __init__(self, path: Path, prefix: str = ""):
        from safetensors import SafetensorError, safe_open

        self.path, self.prefix, self.bytes_read = Path(path), prefix, 0
        try:
            self._file = safe_open(str(self.path), framework="numpy")
            keys = list(self._file.keys())
        except (SafetensorError, OSError, ValueError) as err:
            raise UserError(f"{self.path} cannot be read (truncated or corrupt?): {err}") from None
        self._names = [k[len(prefix):] for k in keys if k.startswith(prefix)]

    def names(self) -> list[str]:
        return list(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file.get_slice(self.prefix + name).get_shape())

    def read(self, name: str, index: Index = ()) -> np.ndarray:
        piece = self._file.get_slice(self.prefix + name)
        out = _as_float32(np.ascontiguousarray(piece[index] if index else piece[:]))
        self.bytes_read += out.nbytes
        return out


class UnionSource:
    """Several sources read as one, each name from the first that holds it: a LoRA run's frozen base (the seed
    or --init-from file) beside its adapters (their initial values, or a checkpoint's)."""

    def __init__(self, *sources: TensorSource):
        self.sources, self.bytes_read = sources, 0
        self._where: dict[str, TensorSource] = {}
        for source in sources:
            for name in source.names():
                self._where.setdefault(name, source)

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._where[name].shape(name)

    def read(self, name: str, index: Index = ()) -> np.ndarray:
        out = self._where[name].read(name, index)
        self.bytes_read += out.nbytes
        return out


def read_all(source: TensorSource) -> dict[str, np.ndarray]:
    """Every tensor whole: what a replicated strategy keeps."""
    return {name: source.read(name) for name in source.names()}


def as_source(weights) -> TensorSource:
    """A TensorSource as is; a dict of whole arrays (tests, benchmarks, diagnose) wrapped in a DictSource."""
    return DictSource(weights) if isinstance(weights, dict) else weights


def check_source(spec, source: TensorSource, where: str, expected: dict | None = None) -> None:
    """Every tensor the spec needs (or `expected`: {name: shape}, a LoRA checkpoint's adapters), under its name and
    shape, read from the header alone: the checks of common/model/weights.py's check_weights on zero-byte
    stand-ins (np.broadcast_to allocates nothing)."""
    from common.model.weights import check_weights

    check_weights(spec, {n: np.broadcast_to(np.float32(0), source.shape(n)) for n in source.names()}, where,
                  expected)


def probe_checksum(source: TensorSource) -> float:
    """A checksum of the source that any rank computes alike whatever it keeps: the first row of every
    tensor and every shape. It tells two seed files apart (another seed, another spec, another file) for a
    few KB read, where a checksum of the whole would make every rank read the whole model."""
    total = 0.0
    for name in source.names():
        shape = source.shape(name)
        total += float(np.abs(source.read(name, (slice(0, 1),))).sum(dtype=np.float64)) + sum(shape)
    return total
