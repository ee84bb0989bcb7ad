"""MLX's quantized matmul against dequantize + BLAS on this CPU, forward (x W^T) and backward (g W) products of a
4-bit, group-64 matrix at the shapes of `tiny`, `small` and Llama-3.2-1B's blocks, beside the float32 product.
Why mlx_impl/quantized.py dequantizes on a CPU: MLX's CPU quantized kernel has no BLAS behind it.

    .venv/bin/python benchmarks/bench_quantized.py

It runs itself again under the BLAS a run gets (compare/machine/environment.py mlx_blas: the system OpenBLAS,
preloaded, with the core it should use), one thread, 5 repeats after a warm-up; ms per product.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHAPES = [(1024, 64, 64), (1024, 256, 256), (1024, 256, 512), (512, 2048, 2048), (512, 2048, 8192)]  # (tokens, in, out)


def measure() -> None:
    import mlx.core as mx

    def ms(f, repeats: int = 5) -> float:
        mx.eval(f())
        start = time.perf_counter()
        for _ in range(repeats):
            mx.eval(f())
        return (time.perf_counter() - start) / repeats * 1e3

    print("| tokens x in x out | quantized_matmul x W^T | g W | dequantize + matmul x W^T | g W | float32 x W^T |")
    print("|---|---|---|---|---|---|")
    for tokens, in_features, out_features in SHAPES:
        w = mx.random.normal((out_features, in_features)) * 0.02
        q, s, b = mx.quantize(w, group_size=64, bits=4)
        x, g = mx.random.normal((tokens, in_features)), mx.random.normal((tokens, out_features))
        mx.eval(q, s, b, x, g, w)
        times = [ms(lambda: mx.quantized_matmul(x, q, s, b, transpose=True, group_size=64, bits=4)),
                 ms(lambda: mx.quantized_matmul(g, q, s, b, transpose=False, group_size=64, bits=4)),
                 ms(lambda: x @ mx.dequantize(q, s, b, group_size=64, bits=4).T),
                 ms(lambda: g @ mx.dequantize(q, s, b, group_size=64, bits=4)),
                 ms(lambda: x @ w.T)]
        print(f"| {tokens} x {in_features} x {out_features} | " + " | ".join(f"{t:.2f}" for t in times) + " |",
              flush=True)


def main() -> None:
    if os.environ.get("DPCOMPARE_BENCH_CHILD"):
        return measure()
    from compare.machine.environment import mlx_blas, thread_env

    blas, env = mlx_blas("auto")
    print(f"BLAS: {blas}", flush=True)
    subprocess.run([sys.executable, __file__], check=True,
                   env={**os.environ, **env, **thread_env(1), "DPCOMPARE_BENCH_CHILD": "1"})


if __name__ == "__main__":
    main()
