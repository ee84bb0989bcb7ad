"""--mlx-exp: MLX's exp against the fused one (mlx_impl/fast_exp.py), in the kernels the model compiles.

    python benchmarks/bench_exp.py [--rows 2048] [--vocab 50257]

For each choice of MLX's CPU kernel flags (--mlx-cpu-jit baseline and native) and of glibc's malloc (as is, and
--tune-malloc's, which keeps freed buffers instead of faulting fresh pages in), a child process times, at the
`small` preset's logits shape and 1 thread: exp(x - row max) compiled, and dpcompare's cross-entropy forward +
backward compiled, with each exp; torch's exp and F.cross_entropy beside them. CPU time per call (minimum of 5),
so other processes' load inflates the figures less than wall time would. Prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def cpu_ms(fn, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best * 1e3


def child(rows: int, vocab: int) -> dict:
    import mlx.core as mx
    import numpy as np
    import torch
    import torch.nn.functional as F

    import mlx_impl.model as model

    torch.set_num_threads(1)
    logits = np.random.default_rng(0).standard_normal((rows, vocab)).astype(np.float32) * 4
    targets = np.random.default_rng(1).integers(0, vocab, rows)
    x, t = mx.array(logits), mx.array(targets)
    mx.eval(x, t)
    out = {}
    for kind in model.EXP_KINDS:
        model.set_exp(kind)
        shifted = mx.compile(lambda z: model._exp_minus(z, z.max(axis=-1, keepdims=True)))
        loss = mx.compile(mx.value_and_grad(lambda z: model.cross_entropy(z, t).sum()))
        out[f"exp(x - max), mlx {kind}"] = cpu_ms(lambda: mx.eval(shifted(x)))
        out[f"cross-entropy fwd+bwd, mlx {kind}"] = cpu_ms(lambda: mx.eval(loss(x)))
    xt, tt = torch.from_numpy(logits), torch.from_numpy(targets)

    def torch_loss():
        z = xt.clone().requires_grad_()
        F.cross_entropy(z, tt, reduction="sum").backward()

    out["exp(x - max), torch"] = cpu_ms(lambda: torch.exp(xt - xt.max(dim=-1, keepdim=True).values))
    out["cross-entropy fwd+bwd, torch"] = cpu_ms(torch_loss)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.rows, args.vocab)))
        return 0
    from common.config import RunConfig
    from compare.machine.environment import cpu_model, malloc_env, mlx_blas, mlx_cpu_jit, thread_env

    columns = {}
    for jit in ("baseline", "native"):
        for malloc in ("glibc default", "--tune-malloc"):
            env = {**os.environ, **thread_env(1), **mlx_blas("auto")[1], **mlx_cpu_jit(jit, RunConfig().cache_path)[1],
                   **(malloc_env() if malloc != "glibc default" else {}),
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
            proc = subprocess.run([sys.executable, __file__, "--child", "--rows", str(args.rows), "--vocab",
                                   str(args.vocab)], env=env, capture_output=True, text=True, check=True)
            columns[f"{jit} kernels, {malloc}"] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"{cpu_model()}, {args.rows} x {args.vocab} float32, 1 thread, CPU ms per call (min of 5), "
          f"load {os.getloadavg()[0]:.1f}\n")
    print("| op | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for op in next(iter(columns.values())):
        print(f"| {op} | " + " | ".join(f"{c[op]:,.0f}" for c in columns.values()) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
