"""common/train/heap.py gives the holes in the middle of glibc's heap back to the OS (issue 25: torch fsdp's peak)."""
from __future__ import annotations

import ctypes
import sys

import pytest

from common.train import heap
BLOCK = 64 * 1024  # under glibc's smallest mmap threshold (128 KiB): always served from the heap


def rss_anon_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


@pytest.mark.skipif(not (sys.platform.startswith("linux") and heap.available()), reason="glibc's malloc_trim only")
def test_release_freed_heap_returns_freed_blocks_from_the_middle_of_the_heap():
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(BLOCK) for _ in range(1600)]  # 100 MiB, touched so that it is resident
    assert all(blocks)
    for b in blocks:
        ctypes.memset(b, 1, BLOCK)
    kept = blocks[15::16]  # every 16th stays: the freed 94 MiB are holes, not a top glibc trims by itself
    try:
        for i, b in enumerate(blocks):
            if i % 16 != 15:
                libc.free(b)
        before = rss_anon_bytes()
        assert heap.release_freed_heap()
        returned = before - rss_anon_bytes()
        assert returned > 60 * 2**20, f"only {returned / 2**20:.0f} MiB of 94 MiB of holes went back"
    finally:
        for b in kept:
            libc.free(b)
