"""MLX's attention core on a CPU: the model's (mlx_impl/model.py `attention`) against candidate rewrites and
torch's fused kernel, forward + backward of one layer, float32 (issue 58).

    python benchmarks/bench_attention.py [--batch 8] [--seq 128] [--heads 4] [--kv-heads 2] [--head-dim 16]
                                          [--repeats 100] [--threads 1] [--exp auto|native|fused] [--dtype float32]

The defaults are the demo's tiny layer (configs/demo.toml: batch 8, seq 128); `small` is --seq 256 --kv-heads 4
--head-dim 64. The script re-runs itself in the environment an MLX rank gets (system OpenBLAS preloaded,
--mlx-cpu-jit auto, N threads), then prints the median and p10 ms per call of each variant, all alternating in one
sitting (read p10 where other work loads the machine), and each variant's largest difference from the model's
gradients, relative to the largest value, and of the loss sum(out * random cotangent), which cancels and so
reads larger.

Variants (docs/notes/2026-11-attention-cpu.md has what each measured):
- model: the model's attention as it is (mlx_impl/model.py `_attend`: the mask as a bias added by the scores'
  matmul, the shift subtracted before the exp, (E v) / l, a hand-written backward reading E and l);
- before: the form until issue 58 (mask by `where`, the shift inside the exp's kernels, backward by autodiff);
- shift first: before, with the shift subtracted before the exp (the model's bfloat16 path);
- bias: shift first, with the mask added as a 0 / -inf bias instead of `where`;
- softmax vjp: shift first, with the softmax's backward written by hand, dS = P (dP - rowsum(dP P));
- per head: the model's, with k and v repeated per query head (a contiguous (B, H, T, D) layout, no GQA reshape);
- folded: the model's `_attend` with each k/v head's query group as more rows of one matmul (the bias tiled);
- torch: torch's scaled_dot_product_attention (its CPU flash kernel), the target.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = "DPCOMPARE_BENCH_ATTENTION_CHILD"


def variants(scale: float, T: int, exp: str):
    """name -> attention(q, k, v): the model's and the forms it replaced (float32)."""
    from typing import cast

    import mlx.core as mx
    import numpy as np

    from mlx_impl import attention, kernels, model

    model.set_exp(exp)
    causal = attention._causal_mask(T)
    bias = mx.where(causal, mx.array(0.0), mx.array(-mx.inf))

    def grouped(q, k, v):
        B, H, _, D = q.shape
        if H != k.shape[1]:
            return q.reshape(B, k.shape[1], H // k.shape[1], T, D), k[:, :, None], v[:, :, None]
        return q, k, v

    def shifted_in_kernel(s):  # the softmax until issue 58: the row max subtracted inside the exp's kernels
        s32 = s.astype(mx.float32)
        e = kernels._exp_minus(s32, s32.max(axis=-1, keepdims=True), exp)
        return (e / e.sum(axis=-1, keepdims=True)).astype(s.dtype)

    softmax_before = mx.compile(shifted_in_kernel)

    def step_by_step(softmax, masked=True):
        def f(q, k, v):
            B, H, _, D = q.shape
            q, k, v = grouped(q, k, v)
            s = (q * scale) @ k.swapaxes(-1, -2)
            s = mx.where(causal, s, mx.array(-mx.inf, dtype=s.dtype)) if masked else s + bias
            return (softmax(s) @ v).reshape(B, H, T, D)
        return f

    @mx.custom_function
    def softmax_vjp(s):
        return kernels._softmax(s, exp)

    @softmax_vjp.vjp
    def _softmax_vjp(primals, cotangent, output):
        return output * (cotangent - (cotangent * output).sum(axis=-1, keepdims=True))

    def per_head(q, k, v):
        H = q.shape[1]
        if H != k.shape[1]:
            k, v = mx.repeat(k, H // k.shape[1], axis=1), mx.repeat(v, H // k.shape[1], axis=1)
        return model.attention(q, k, v, scale, "causal")

    def in_blocks(blocks):  # the model's core in blocks of queries (model.set_attention; auto times them)
        def f(q, k, v):
            B, H, _, D = q.shape
            qg, kg, vg = grouped(q * scale, k, v)
            return attention._attend_in_blocks(qg, kg, vg, bias, blocks).reshape(B, H, T, D)
        return f

    def folded(q, k, v):  # each k/v head's query group as more rows of one matmul, the bias tiled to match
        B, H, _, D = q.shape
        g = H // k.shape[1]
        qf = (q * scale).reshape(B, k.shape[1], g * T, D)
        tiled = mx.array(np.tile(np.array(bias), (g, 1)))
        return cast(tuple, attention._attend(qf, k, v, tiled))[0].reshape(B, H, T, D)

    return {"model": lambda q, k, v: model.attention(q, k, v, scale, "causal"),
            "folded": folded,
            **{kind: in_blocks(n) for kind, n in attention.ATTENTION_BLOCKS.items()},
            "before": step_by_step(softmax_before),
            "shift first": step_by_step(kernels._SOFTMAX[exp]),
            "bias": step_by_step(kernels._SOFTMAX[exp], masked=False),
            "softmax vjp": step_by_step(softmax_vjp),
            "per head": per_head}


def main_child(a) -> None:
    import mlx.core as mx
    import numpy as np

    rng = np.random.default_rng(0)
    shapes = [(a.batch, h, a.seq, a.head_dim) for h in (a.heads, a.kv_heads, a.kv_heads)]
    arrays = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    dtype = getattr(mx, a.dtype)
    q, k, v = (mx.array(x).astype(dtype) for x in arrays)
    cot = mx.array(rng.standard_normal(shapes[0]).astype(np.float32)).astype(dtype)
    scale = a.head_dim ** -0.5
    steps = {}
    for name, f in variants(scale, a.seq, os.environ[CHILD]).items():
        def loss(q, k, v, f=f):
            return (f(q, k, v) * cot).astype(mx.float32).sum()
        steps[name] = mx.compile(mx.value_and_grad(loss, argnums=(0, 1, 2)))
    timed = {name: (lambda s=step: mx.eval(s(q, k, v))) for name, step in steps.items()}
    outs = {name: step(q, k, v) for name, step in steps.items()}
    mx.eval(outs)
    torch_step = _torch_step(arrays, np.array(cot.astype(mx.float32)), scale, a.threads)
    if torch_step is not None:
        timed["torch"] = torch_step
        timed["torch gqa"] = _torch_step(arrays, np.array(cot.astype(mx.float32)), scale, a.threads, gqa=True)
    for f in timed.values():
        f()
    times: dict[str, list[float]] = {name: [] for name in timed}
    for _ in range(a.repeats):
        for name, f in timed.items():
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    ref_val, ref_grads = outs["model"]
    for name in timed:
        line = f"{name:12s} {1e3 * np.median(times[name]):7.3f} ms  [p10 {1e3 * np.percentile(times[name], 10):.3f}, " \
               f"p90 {1e3 * np.percentile(times[name], 90):.3f}]"
        if name in outs:
            val, grads = outs[name]
            diff = max(float(np.abs(np.array(g.astype(mx.float32)) - np.array(r.astype(mx.float32))).max()
                             / np.abs(np.array(r.astype(mx.float32))).max()) for g, r in zip(grads, ref_grads))
            line += f"  loss rel diff {abs(float(val) - float(ref_val)) / abs(float(ref_val)):.1e}  " \
                    f"grad max rel diff {diff:.1e}"
        print(line, flush=True)


def _torch_step(arrays, cot, scale, threads, gqa=False):
    """torch's fused core, k and v repeated per query head, or with gqa=True not repeated (enable_gqa), as
    torch_impl/attention.py calls it and the op classes time it; None without torch."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    torch.set_num_threads(threads)
    q, k, v = (torch.from_numpy(x).requires_grad_() for x in arrays)
    c = torch.from_numpy(cot)
    groups = 1 if gqa else q.shape[1] // k.shape[1]

    def step():
        for t in (q, k, v):
            t.grad = None
        kk, vv = (t.repeat_interleave(groups, dim=1) if groups > 1 else t for t in (k, v))
        (F.scaled_dot_product_attention(q, kk, vv, is_causal=True, scale=scale, enable_gqa=gqa) * c).sum().backward()
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--exp", default="auto", help="auto: the choice --mlx-exp auto makes at these shapes")
    parser.add_argument("--mlx-cpu-jit", default="auto")
    a = parser.parse_args()
    if os.environ.get(CHILD):
        sys.path.insert(0, str(ROOT))
        return main_child(a)
    sys.path.insert(0, str(ROOT))
    from common.config import RunConfig
    from compare.machine.environment import mlx_blas, mlx_cpu_jit, thread_env
    from compare.machine.kernels import described

    cfg = RunConfig(mlx_cpu_jit=a.mlx_cpu_jit, seq_len=a.seq, global_batch_size=a.batch,
                    model={"n_heads": a.heads, "n_kv_heads": a.kv_heads, "dim": a.heads * a.head_dim})
    exp = a.exp if a.exp != "auto" else described(cfg, "exp")
    blas, env_blas = mlx_blas("auto")
    jit, env_jit = mlx_cpu_jit(a.mlx_cpu_jit, cfg.cache_path)
    print(f"BLAS: {blas}; fused CPU kernels: {jit}; exp: {exp}; {a.threads} thread(s); batch {a.batch}, seq "
          f"{a.seq}, heads {a.heads} (kv {a.kv_heads}) x {a.head_dim}, {a.dtype}; fwd+bwd of one layer's attention "
          f"core, median of {a.repeats}, load {os.getloadavg()[0]:.1f}", flush=True)
    env = {**os.environ, **env_blas, **env_jit, **thread_env(a.threads), CHILD: exp.split()[0]}
    sys.exit(subprocess.call([sys.executable, *sys.argv], env=env))


if __name__ == "__main__":
    main()
