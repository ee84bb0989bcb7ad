"""Write a safetensors file one tensor at a time, in any order, never holding more than the tensor in hand.

safetensors' own `save_file` takes a dict of every tensor, so whoever writes a whole-file checkpoint must
first hold the whole state (for fsdp's rank 0: weights and both AdamW moments, gathered, 3x the model).
The format makes streaming easy: an 8-byte header length, a JSON header naming each tensor's dtype, shape and
byte range, then the bytes. The names and shapes are known before any tensor is (the model spec), so the
header is written first, the file is sized, and each tensor is written at its own offset when it arrives,
in whatever order the ranks' collectives produce them.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np


DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.float64): "F64",
          np.dtype(np.int64): "I64", np.dtype(np.int32): "I32"}


class SafetensorsWriter:
    """`with SafetensorsWriter(path, shapes) as out: out.write(name, array)` for every name of `shapes`.

    Every tensor is stored as `dtype` (float32 by default: checkpoints and exports keep float32 weights and
    moments); closing without every tensor written, or writing one twice, raises and leaves the file
    incomplete (the caller writes into a temporary directory that is only renamed into place when whole)."""

    def __init__(self, path: Path, shapes: dict[str, tuple[int, ...]], dtype=np.float32,
                 metadata: dict[str, str] | None = None):
        self.path, self.dtype = Path(path), np.dtype(dtype)
        header: dict[str, object] = {}
        self.ranges: dict[str, tuple[int, int, tuple[int, ...]]] = {}
        offset = 0
        if metadata:
            header["__metadata__"] = dict(metadata)
        for name, shape in shapes.items():  # byte ranges in the order given: contiguous, as the format requires
            size = int(np.prod(shape, dtype=np.int64)) * self.dtype.itemsize
            header[name] = {"dtype": DTYPES[self.dtype], "shape": [int(d) for d in shape],
                            "data_offsets": [offset, offset + size]}
            self.ranges[name] = (offset, size, tuple(int(d) for d in shape))
            offset += size
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self.data_start = 8 + len(encoded)
        self.written: set[str] = set()
        self.file = open(self.path, "wb")
        self.file.write(len(encoded).to_bytes(8, "little") + encoded)
        self.file.truncate(self.data_start + offset)

    def write(self, name: str, array: np.ndarray) -> None:
        if name not in self.ranges:
            raise ValueError(f"{self.path.name}: {name!r} is not a tensor of this file")
        if name in self.written:
            raise ValueError(f"{self.path.name}: {name!r} written twice")
        offset, size, shape = self.ranges[name]
        array = np.ascontiguousarray(array, dtype=self.dtype)
        if array.shape != shape:
            raise ValueError(f"{self.path.name}: {name!r} has shape {array.shape}, the header says {shape}")
        self.file.seek(self.data_start + offset)
        self.file.write(array.data.cast("B"))
        self.written.add(name)

    def close(self) -> None:
        missing = [name for name in self.ranges if name not in self.written]
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        if missing:
            raise ValueError(f"{self.path.name}: {len(missing)} tensors never written ({', '.join(missing[:3])}...)")

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.close()
        else:  # an error mid-write: close the handle, keep the first error
            self.file.close()
