"""Freed heap memory given back to the operating system (glibc's `malloc_trim`), framework-neutral.

Why a rank needs it. glibc serves an allocation below its mmap threshold from the heap, and the threshold
rises to the largest block freed so far, up to 32 MB (mallopt(3), M_MMAP_THRESHOLD). After a run's first
steps every block-sized tensor (a gathered parameter, an unsharded gradient, an activation) comes from the
heap, and a block freed in the middle of the heap stays resident: only the top is returned by itself.
Under torch's fsdp those freed blocks reached 300-480 MiB in the backward on `base`, a fifth of the rank's
peak RSS (docs/benchmarks.md, "torch fsdp returns its freed heap"); torch_impl/fsdp.py calls
`release_freed_heap` twice per backward, where its peak comes.

`--tune-malloc` asks for the opposite (keep freed memory, for speed), so callers skip this under it.
"""
from __future__ import annotations

import ctypes
import functools
import sys


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None where there is none (macOS, musl)."""
    if not sys.platform.startswith("linux"):
        return None
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # the C library this process already runs
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def available() -> bool:
    return _malloc_trim() is not None


def release_freed_heap() -> bool:
    """Return every whole free page of the heap to the OS (malloc_trim(0): the middle of the heap too, not only
    its top). True when some memory was returned. The pages fault in again when the heap reuses them: the
    two calls of a torch fsdp backward cost 1-14 % of a step on `base`, 4-10 % on `small` (docs/benchmarks.md)."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
