"""The fp32 matmul rate MLX reaches here: the measured peak behind CPU MFU in the report.

`python -m mlx_impl.peak --threads 1` prints one JSON line. Threads come from the environment, as in a
run: on Linux the mlx wheel's CPU matmuls go to whatever BLAS is loaded (compare/machine/peak.py preloads the
system OpenBLAS the way the launcher does) and that library reads OPENBLAS_NUM_THREADS at load time,
so a thread count only takes effect when it is in the environment before mlx is imported.
Mirrors torch_impl/peak.py name for name.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time

MIN_BATCH_S = 0.05   # a timed batch of matmuls lasts at least this long, so timer noise stays small
MAX_BATCH = 64       # ... but holds at most this many results in memory


def measure_matmul_flops(n: int | None = None, repeats: int = 10, threads: int = 1,
                         device: str = "cpu") -> dict:
    """Best-of-`repeats` rate of n x n float32 matmuls, in FLOP/s (2 n^3 per matmul).

    n defaults to 1024 on the CPU and 4096 on a GPU (a 1024 matmul cannot fill a large GPU).
    """
    import mlx.core as mx

    if device == "gpu" or (device == "auto" and mx.is_available(mx.gpu)):
        mx.set_default_device(mx.gpu)
    else:
        mx.set_default_device(mx.cpu)
    on_gpu = mx.default_device() == mx.gpu
    n = n or (4096 if on_gpu else 1024)
    a = mx.random.normal((n, n), dtype=mx.float32, key=mx.random.key(0))
    b = mx.random.normal((n, n), dtype=mx.float32, key=mx.random.key(1))
    mx.eval(a, b)
    # Warm up: BLAS thread pools start and GPU kernels compile on the first calls.
    for _ in range(2):
        mx.eval(a @ b)
    start = time.perf_counter()
    mx.eval(a @ b)
    batch = min(MAX_BATCH, max(1, math.ceil(MIN_BATCH_S / max(time.perf_counter() - start, 1e-7))))
    best_s = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval([a @ b for _ in range(batch)])  # independent products: a GPU queues them back to back
        best_s = min(best_s, (time.perf_counter() - start) / batch)
    return {"flops": 2.0 * n ** 3 / best_s, "device": "gpu" if on_gpu else "cpu", "threads": threads,
            "n": n, "matmul_s": best_s, "framework": "mlx", "version": getattr(mx, "__version__")}  # not in MLX's stubs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--n", type=int, default=None, help="matrix size (default 1024 CPU, 4096 GPU)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cpu", choices=("cpu", "gpu", "auto"))
    args = parser.parse_args(argv)
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "VECLIB_MAXIMUM_THREADS"):
        os.environ.setdefault(name, str(args.threads))  # only effective before mlx loads its BLAS
    print(json.dumps(measure_matmul_flops(args.n, args.repeats, args.threads, args.device)))
    return 0


if __name__ == "__main__":
    from common.train.process_exit import exit_now

    exit_now(main())  # no interpreter teardown: 1-1.5 s of a torch process (common/train/process_exit.py)
