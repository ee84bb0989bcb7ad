"""The fp32 matmul rate torch reaches here: the measured peak behind CPU MFU in the report.

`python -m torch_impl.peak --threads 1` prints one JSON line. Threads are set the way a run sets them:
the OMP/MKL/OpenBLAS variables (compare/machine/peak.py passes compare.machine.environment.thread_env) and
torch.set_num_threads. Mirrors mlx_impl/peak.py name for name.
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
    float32 stays float32: TF32 is left at torch's default (off), as in a run.
    """
    import torch

    torch.set_num_threads(threads)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    on_gpu = dev.type in ("cuda", "mps")
    n = n or (4096 if on_gpu else 1024)
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=generator).to(dev)
    b = torch.randn(n, n, generator=generator).to(dev)

    def sync():  # GPU kernels run asynchronously: time only finished work
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        elif dev.type == "mps":
            torch.mps.synchronize()

    # Warm up: thread pools start and GPU libraries pick their kernels on the first calls.
    for _ in range(2):
        a @ b
    sync()
    start = time.perf_counter()
    a @ b
    sync()
    batch = min(MAX_BATCH, max(1, math.ceil(MIN_BATCH_S / max(time.perf_counter() - start, 1e-7))))
    best_s = math.inf
    with torch.no_grad():
        for _ in range(repeats):
            sync()
            start = time.perf_counter()
            for _ in range(batch):
                a @ b
            sync()
            best_s = min(best_s, (time.perf_counter() - start) / batch)
    result = {"flops": 2.0 * n ** 3 / best_s, "device": str(dev), "threads": threads, "n": n,
              "matmul_s": best_s, "framework": "torch", "version": torch.__version__, "blas": _blas()}
    if dev.type == "cuda":
        result["device_name"] = torch.cuda.get_device_name(dev)
    return result


def _blas() -> str:
    """The BLAS torch was built with, from its build configuration (CPU matmuls only)."""
    import torch

    for line in torch.__config__.show().splitlines():
        if "BLAS_INFO=" in line:
            return "torch built-in: " + line.split("BLAS_INFO=", 1)[1].split(",")[0]
    return "torch built-in: mkl" if torch.backends.mkl.is_available() else "torch built-in"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--n", type=int, default=None, help="matrix size (default 1024 CPU, 4096 GPU)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda", "mps", "auto"))
    args = parser.parse_args(argv)
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "VECLIB_MAXIMUM_THREADS"):
        os.environ.setdefault(name, str(args.threads))
    print(json.dumps(measure_matmul_flops(args.n, args.repeats, args.threads, args.device)))
    return 0


if __name__ == "__main__":
    from common.train.process_exit import exit_now

    exit_now(main())  # no interpreter teardown: 1-1.5 s of a torch process (common/train/process_exit.py)
