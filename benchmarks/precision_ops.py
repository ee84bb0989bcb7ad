"""The ops of a `small` step in float32 and bfloat16, one framework: `precision_ops.py mlx|torch OUT [REPEATS]`.

Started by bench_precision.py the way the runner starts a rank (same threads, MLX with the same BLAS), so
the times are those a training step sees. Shapes are `small`'s at 1,024 tokens per step (batch 8 x seq
128, dim 256, ffn 512, 4 heads of 64, vocab 50,257). Each op runs forward only, best of REPEATS after a
warmup call, inputs already in the dtype; a matmul's backward is two more matmuls of the same size, so its share of a step is about
what the forward shows. Writes {op: {dtype: seconds}} to OUT as JSON.
"""
import json
import sys
import time

framework, out = sys.argv[1], sys.argv[2]
repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 5
B, T, DIM, FFN, HEADS, VOCAB = 8, 128, 256, 512, 4, 50257
N = B * T
# name -> (M, K, N) of x @ w.T; per step each runs once per layer (4), lm_head once.
MATMULS = {"matmul q/k/v/o (1024x256 @ 256x256)": (N, DIM, DIM),
           "matmul gate/up (1024x256 @ 256x512)": (N, DIM, FFN),
           "matmul down (1024x512 @ 512x256)": (N, FFN, DIM),
           "matmul lm_head (1024x256 @ 256x50257)": (N, DIM, VOCAB)}


def best(fn) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


results: dict[str, dict[str, float]] = {}
if framework == "mlx":
    import mlx.core as mx
    import mlx.nn as nn

    def timed(name, dtype, make, op):
        args = make()
        mx.eval(*args)
        results.setdefault(name, {})[dtype] = best(lambda: mx.eval(op(*args)))

    for dtype in ("float32", "bfloat16"):
        dt = getattr(mx, dtype)

        def rnd(*shape):
            return mx.random.normal(shape).astype(dt)

        for name, (m, k, n) in MATMULS.items():
            timed(name, dtype, lambda: (rnd(m, k), rnd(n, k)), lambda x, w: x @ w.T)
        if dtype != "float32":  # what casting a master weight at use costs (float32 needs none)
            timed("cast lm_head weight from float32 (50257x256)", dtype, lambda: (mx.random.normal((VOCAB, DIM)),),
                  lambda w: w.astype(dt))
        timed("attention (8x4x128x64, causal)", dtype, lambda: (rnd(B, HEADS, T, 64),) * 3,
              lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal"))
        timed("rms_norm (1024x256)", dtype, lambda: (rnd(N, DIM), mx.ones(DIM)),
              lambda x, w: mx.fast.rms_norm(x.astype(mx.float32), None, 1e-5).astype(x.dtype) * w.astype(x.dtype))
        timed("silu(gate) * up (1024x512)", dtype, lambda: (rnd(N, FFN), rnd(N, FFN)), lambda g, u: nn.silu(g) * u)
        timed("cross-entropy, float32 (1024x50257)", dtype,
              lambda: (rnd(N, VOCAB), mx.random.randint(0, VOCAB, (N,))),
              lambda z, y: nn.losses.cross_entropy(z.astype(mx.float32), y, reduction="sum"))
else:
    import os

    import torch
    import torch.nn.functional as F

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))

    def timed(name, dtype, make, op):
        args = make()
        with torch.no_grad():
            results.setdefault(name, {})[dtype] = best(lambda: op(*args))

    for dtype in ("float32", "bfloat16"):
        dt = getattr(torch, dtype)

        def rnd(*shape):
            return torch.randn(*shape).to(dt)

        for name, (m, k, n) in MATMULS.items():
            timed(name, dtype, lambda: (rnd(m, k), rnd(n, k)), lambda x, w: F.linear(x, w))
        if dtype != "float32":  # what casting a master weight at use costs (float32 needs none)
            timed("cast lm_head weight from float32 (50257x256)", dtype, lambda: (torch.randn(VOCAB, DIM),),
                  lambda w: w.to(dt))
        timed("attention (8x4x128x64, causal)", dtype, lambda: (rnd(B, HEADS, T, 64),) * 3,
              lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125))
        timed("rms_norm (1024x256)", dtype, lambda: (rnd(N, DIM), torch.ones(DIM)),
              lambda x, w: F.rms_norm(x.float(), (DIM,), None, 1e-5).to(x.dtype) * w.to(x.dtype))
        timed("silu(gate) * up (1024x512)", dtype, lambda: (rnd(N, FFN), rnd(N, FFN)), lambda g, u: F.silu(g) * u)
        timed("cross-entropy, float32 (1024x50257)", dtype,
              lambda: (rnd(N, VOCAB), torch.randint(0, VOCAB, (N,))),
              lambda z, y: F.cross_entropy(z.float(), y, reduction="sum"))

with open(out, "w") as f:
    json.dump(results, f, indent=2)
