"""Ops where MLX on a CPU is the limit: each op on the `small` head's logits (2048 tokens x 50257, float32),
MLX against torch, one thread each, minimum of a few calls after a warmup.

    python benchmarks/bench_ops.py [--out runs/bench/ops.json]

The time breakdown (common/breakdown.py) puts MLX's gap to torch on `small` in the forward pass; this
isolates the op behind most of it: the exponential inside logsumexp/softmax of the cross-entropy. A
minimal reproduction to send upstream is printed with the table (docs/benchmarks.md has it too).
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import benchlib  # noqa: E402

SHAPE = (2048, 50257)
REPEATS = 3

REPRO = """import time, mlx.core as mx
x = mx.random.normal((2048, 50257)); mx.eval(x)
for f in (mx.exp, lambda z: mx.logsumexp(z, axis=-1)):
    mx.eval(f(x)); t = time.perf_counter(); mx.eval(f(x)); print(time.perf_counter() - t)"""


def best(fn, sync) -> float:
    sync(fn())
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        sync(fn())
        times.append(time.perf_counter() - start)
    return min(times)


def mlx_times() -> dict:
    import mlx.core as mx
    import mlx.nn as nn

    x = mx.random.normal(SHAPE)
    t = mx.random.randint(0, SHAPE[1], (SHAPE[0],))
    mx.eval(x, t)
    grad = mx.grad(lambda z: nn.losses.cross_entropy(z, t, reduction="none").sum())
    ops = {"exp": lambda: mx.exp(x), "max (row)": lambda: x.max(axis=-1),
           "logsumexp (row)": lambda: mx.logsumexp(x, axis=-1), "softmax (row)": lambda: mx.softmax(x, axis=-1),
           "cross_entropy forward": lambda: nn.losses.cross_entropy(x, t, reduction="none"),
           "cross_entropy forward+backward": lambda: grad(x)}
    return {name: best(fn, mx.eval) for name, fn in ops.items()}


def torch_times() -> dict:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    x = torch.randn(SHAPE)
    t = torch.randint(0, SHAPE[1], (SHAPE[0],))
    xr = x.clone().requires_grad_()

    def fwd_bwd():
        xr.grad = None
        F.cross_entropy(xr, t, reduction="none").sum().backward()
        return xr.grad

    ops = {"exp": lambda: torch.exp(x), "max (row)": lambda: x.max(dim=-1).values,
           "logsumexp (row)": lambda: torch.logsumexp(x, -1), "softmax (row)": lambda: torch.softmax(x, -1),
           "cross_entropy forward": lambda: F.cross_entropy(x, t, reduction="none"),
           "cross_entropy forward+backward": fwd_bwd}
    return {name: best(fn, lambda r: None) for name, fn in ops.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench/ops.json"))
    a = parser.parse_args()
    mlx, torch = mlx_times(), torch_times()
    rows = [{"op": op, "mlx_ms": 1e3 * mlx[op], "torch_ms": 1e3 * torch[op], "mlx_over_torch": mlx[op] / torch[op]}
            for op in mlx]
    benchlib.print_table(rows, [("op", "op", ""), ("mlx_ms", "MLX ms", ",.0f"), ("torch_ms", "torch ms", ",.0f"),
                                ("mlx_over_torch", "MLX / torch", ".1f")],
                         title=f"ops on {SHAPE[0]} x {SHAPE[1]} float32, 1 thread")
    print("\nminimal reproduction (MLX):\n" + REPRO)
    benchlib.write_result(a.out, "ops", {"shape": SHAPE, "repeats": REPEATS, "out": str(a.out)}, rows)


if __name__ == "__main__":
    main()
