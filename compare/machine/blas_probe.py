"""A child's check of one BLAS library: does it load, compute an sgemm right, and how fast, on this CPU.

Run as `python blas_probe.py LIBRARY THREADS` with the environment MLX's ranks would get (the library preloaded,
OPENBLAS_CORETYPE where set). It imports no framework, only numpy for the operands and a float64 reference; numpy's
own OpenBLAS prefixes its symbols (scipy_cblas_sgemm), so the cblas_sgemm called here is the library's. A library
built for another CPU dies here with SIGILL, and one whose dependency is missing fails to load, before any rank
starts (compare/machine/blas.py). Prints one JSON line.
"""
from __future__ import annotations

import ctypes
import json
import sys
import time

# The shape FACTS.md's measurements used (a Llama MLP's projection at a few hundred rows): 512 x 2048 x 512.
M, K, N = 512, 2048, 512
MIN_WALL_S = 0.3   # time repeats for at least this long (MLX's reference BLAS takes ~0.2 s a call)
MAX_REPEATS = 20
ROW_MAJOR, NO_TRANS = 101, 111


def main() -> int:
    import numpy as np

    library, threads = sys.argv[1], int(sys.argv[2])
    lib = ctypes.CDLL(library)
    core = None
    if hasattr(lib, "openblas_get_corename"):
        lib.openblas_get_corename.restype = ctypes.c_char_p
        core = lib.openblas_get_corename().decode()
    sgemm = lib.cblas_sgemm
    rng = np.random.default_rng(0)
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float32)
    c = np.zeros((M, N), dtype=np.float32)
    ptr = ctypes.POINTER(ctypes.c_float)
    args = (ROW_MAJOR, NO_TRANS, NO_TRANS, M, N, K, ctypes.c_float(1.0), a.ctypes.data_as(ptr), K,
            b.ctypes.data_as(ptr), N, ctypes.c_float(0.0), c.ctypes.data_as(ptr), N)
    sgemm(*args)  # warm: the thread pool, the pages
    exact = a.astype(np.float64) @ b.astype(np.float64)
    error = float(np.abs(c - exact).max() / np.abs(exact).max())
    best, repeats = float("inf"), 0
    wall, cpu = time.perf_counter(), time.process_time()
    while repeats < 2 or (time.perf_counter() - wall < MIN_WALL_S and repeats < MAX_REPEATS):
        start = time.perf_counter()
        sgemm(*args)
        best = min(best, time.perf_counter() - start)
        repeats += 1
    share = (time.process_time() - cpu) / max(time.perf_counter() - wall, 1e-9) / max(threads, 1)
    print(json.dumps({"core": core, "gflops": 2 * M * K * N / best / 1e9, "relative_error": error,
                      "cpu_share": round(share, 2), "shape": [M, K, N], "threads": threads}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
