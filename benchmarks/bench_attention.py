"""MLX attention on the CPU: mx.fast.scaled_dot_product_attention against the same attention written out and
compiled (mlx_impl/model.py `attention`), forward + backward of one layer, in float32 and bfloat16.

    python benchmarks/bench_attention.py [--batch 8] [--seq 128] [--heads 4] [--kv-heads 2] [--head-dim 16]
                                          [--repeats 200] [--threads 1]

The defaults are the demo's tiny layer (configs/demo.toml: batch 8, seq 128). The script re-runs itself
in the environment an MLX rank gets (system OpenBLAS preloaded, --mlx-cpu-jit auto, N threads), then
prints the median ms per call of each variant, alternating them, and the largest difference of their
outputs and gradients against the fused kernel. Upstream-style: it needs only mlx and numpy once the
environment is set (the variants are in this file, not imported).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

CHILD = "DPCOMPARE_BENCH_ATTENTION_CHILD"


def written_out(q, k, v, scale, mask, softmax):
    import mlx.core as mx
    B, H, T, D = q.shape
    Hk = k.shape[1]
    if H != Hk:  # grouped-query: each k/v head serves H / Hk query heads
        q = q.reshape(B, Hk, H // Hk, T, D)
        k, v = k[:, :, None], v[:, :, None]
    scores = (q * mx.array(scale, q.dtype)) @ k.swapaxes(-1, -2)
    scores = mx.where(mask, scores, mx.array(-mx.inf, scores.dtype))
    return (softmax(scores) @ v).reshape(B, H, T, D)


def main_child(a) -> None:
    import mlx.core as mx
    import numpy as np

    def primitive(s):
        return mx.softmax(s, axis=-1, precise=True)

    def by_hand(s):  # the exponentials fused by mx.compile into one JIT kernel
        s32 = s.astype(mx.float32)
        e = mx.exp(s32 - mx.stop_gradient(s32.max(axis=-1, keepdims=True)))
        return (e / e.sum(axis=-1, keepdims=True)).astype(s.dtype)

    rng = np.random.default_rng(0)
    scale = a.head_dim ** -0.5
    T = a.seq
    mask = mx.arange(T)[:, None] >= mx.arange(T)[None]
    for dtype in (mx.float32, mx.bfloat16):
        q, k, v = (mx.array(rng.standard_normal((a.batch, h, T, a.head_dim)).astype(np.float32)).astype(dtype)
                   for h in (a.heads, a.kv_heads, a.kv_heads))
        variants = {
            "fast sdpa": lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal"),
            "written out, softmax primitive": lambda q, k, v: written_out(q, k, v, scale, mask, primitive),
            "written out, softmax by hand": lambda q, k, v: written_out(q, k, v, scale, mask, by_hand),
        }
        steps = {}
        for name, f in variants.items():
            def loss(q, k, v, f=f):
                return (f(q, k, v).astype(mx.float32) ** 2).sum()
            steps[name] = mx.compile(mx.value_and_grad(loss, argnums=(0, 1, 2)))
        outs = {}
        for name, step in steps.items():  # warm up, compile
            outs[name] = step(q, k, v)
            mx.eval(outs[name])
        times = {name: [] for name in steps}
        for _ in range(a.repeats):
            for name, step in steps.items():
                t0 = time.perf_counter()
                mx.eval(step(q, k, v))
                times[name].append(time.perf_counter() - t0)
        ref_val, ref_grads = outs["fast sdpa"]
        for name in steps:
            val, grads = outs[name]
            diff = max(float(np.abs(np.array(g.astype(mx.float32)) - np.array(r.astype(mx.float32))).max()
                           / (np.abs(np.array(r.astype(mx.float32))).max() + 1e-30)) for g, r in zip(grads, ref_grads))
            print(f"{str(dtype):15s} {name:32s} {1e3 * np.median(times[name]):7.3f} ms  "
                  f"[p10 {1e3 * np.percentile(times[name], 10):.3f}, p90 {1e3 * np.percentile(times[name], 90):.3f}]  "
                  f"loss rel diff {abs(float(val) - float(ref_val)) / abs(float(ref_val)):.1e}  "
                  f"grad max rel diff {diff:.1e}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--mlx-cpu-jit", default="auto")
    a = parser.parse_args()
    if os.environ.get(CHILD):
        return main_child(a)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from compare.machine.environment import mlx_blas, mlx_cpu_jit, thread_env
    blas, env_blas = mlx_blas("auto")
    jit, env_jit = mlx_cpu_jit(a.mlx_cpu_jit, Path.home() / ".cache" / "dpcompare")
    print(f"BLAS: {blas}; fused CPU kernels: {jit}; {a.threads} thread(s); batch {a.batch}, seq {a.seq}, "
          f"heads {a.heads} (kv {a.kv_heads}) x {a.head_dim}; fwd+bwd of one layer, median of {a.repeats}", flush=True)
    env = {**os.environ, **env_blas, **env_jit, **thread_env(a.threads), CHILD: "1"}
    sys.exit(subprocess.call([sys.executable, *sys.argv], env=env))


if __name__ == "__main__":
    main()
