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
    """One safetensors file, read with pread, one tensor (or one slice of its rows) at a time; `prefix` selects and
    strips a name prefix ("exp_avg." of an optimizer file), so a checkpoint's moments read like its weights.

    Not through safetensors' own reader: it maps the file, and every page a rank touched stayed in its RSS until the
    file was closed, so loading a model peaked at twice its bytes (Llama-3.2-1B's shape: 9.3 GiB against 4.6 held,
    benchmarks/bench_lora_1b.py). Read into the rank's own arrays, the file's pages are the page cache's."""

    DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64,
              "I32": np.int32, "U32": np.uint32, "I16": np.int16, "U16": np.uint16, "I8": np.int8, "U8": np.uint8,
              "BOOL": np.bool_}

    def __init__(self, path: Path, prefix: str = ""):
        import json
        import os

        self.path, self.prefix, self.bytes_read = Path(path), prefix, 0
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
            size = os.fstat(self._fd).st_size
            header_len = int.from_bytes(os.pread(self._fd, 8, 0), "little")
            if size < 8 or not 0 < header_len <= size - 8:
                raise ValueError(f"a header of {header_len} bytes in a file of {size}")
            header = json.loads(os.pread(self._fd, header_len, 8))
            self._start = 8 + header_len
            self._entries = {k: v for k, v in header.items() if k != "__metadata__"}
            for entry in self._entries.values():
                if entry["dtype"] not in self.DTYPES or self._start + entry["data_offsets"][1] > size:
                    raise ValueError(f"a tensor of dtype {entry['dtype']} ending past the file's end")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise UserError(f"{self.path} cannot be read (truncated or corrupt?): {err}") from None
        self._names = [k[len(prefix):] for k in self._entries if k.startswith(prefix)]

    def __del__(self):
        import os

        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)

    def names(self) -> list[str]:
        return list(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[self.prefix + name]["shape"])

    def read(self, name: str, index: Index = ()) -> np.ndarray:
        import os

        entry = self._entries[self.prefix + name]
        shape, dtype = tuple(entry["shape"]), np.dtype(self.DTYPES[entry["dtype"]])
        rows = range(shape[0])[index[0]] if index and shape else range(shape[0] if shape else 1)
        contiguous = rows.step == 1 or len(rows) <= 1
        first, count = (rows.start, len(rows)) if contiguous else (0, shape[0] if shape else 1)
        row_bytes = dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64)) if shape else dtype.itemsize
        out = np.empty((count, *shape[1:]) if shape else (), dtype)
        buffer = out.reshape(-1).view(np.uint8).data if out.size else memoryview(b"")
        offset, done = self._start + entry["data_offsets"][0] + first * row_bytes, 0
        while done < len(buffer):  # pread may return less than asked
            got = os.preadv(self._fd, [buffer[done:]], offset + done)
            if got <= 0:
                raise UserError(f"{self.path} cannot be read (truncated or corrupt?): {name} ends early")
            done += got
        if not contiguous:
            out = out[index[0]]
        if index[1:]:
            out = out[(slice(None), *index[1:])]
        if entry["dtype"] == "BF16":  # bfloat16 is float32's top half: exact
            out = (out.astype(np.uint32) << 16).view(np.float32)
        out = _as_float32(np.ascontiguousarray(out))
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
