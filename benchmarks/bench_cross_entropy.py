"""The output head and its cross-entropy, forward + backward, in MLX (each shift of `--mlx-exp`'s cross-entropy
choice) and torch: time, and MLX's peak memory counted in logits-sized buffers (issues 56 and 58).

    python benchmarks/bench_cross_entropy.py [--rows 1024] [--dim 64] [--vocab 2048] [--repeats 40] [--threads 1]

The defaults are the demo's head (batch 8 x seq 128 rows, tiny's dim 64, the builtin vocabulary's 2048); `small`'s
is --dim 256 --vocab 50257 --repeats 5. The script re-runs itself in the environment an MLX rank gets (system OpenBLAS
preloaded, --mlx-cpu-jit auto, N threads) and prints, per variant:
- `head+CE`: x @ W^T, then the masked token losses summed, value and gradients of x and W (the step's last part);
- `CE only`: the same losses from a logits array made beforehand (the op-class profile's workload);
- for MLX, `peak`: mx.get_peak_memory() during the call less what was live before it, over rows x vocab x 4 bytes.
  The memory prediction (common/parallel/layout.py activation_bytes) counts 2 such buffers (logits and their
  exponentials).
MLX's rows use the exp `--exp` names (auto: the one --mlx-exp auto chose at these shapes); the kinds are
mlx_impl/model.py CROSS_ENTROPY_KINDS. torch's is F.cross_entropy, one fused kernel per row.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = "DPCOMPARE_BENCH_CE_CHILD"


def _median_ms(fn, repeats: int) -> float:
    import numpy as np

    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def mlx_rows(a, exp: str) -> list[str]:
    import mlx.core as mx
    import numpy as np

    from mlx_impl import model

    model.set_exp(exp)
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((a.rows, a.dim)).astype(np.float32))
    w = mx.array((rng.standard_normal((a.vocab, a.dim)) * 0.02).astype(np.float32))
    t = mx.array(rng.integers(0, a.vocab, (a.rows,)).astype(np.int32))
    m = mx.array((rng.random(a.rows) > 0.1).astype(np.float32))
    logits = x @ w.T
    mx.eval(x, w, t, m, logits)
    logit_bytes = a.rows * a.vocab * 4
    lines = []
    for kind in model.CROSS_ENTROPY_KINDS:
        def ce(z, kind=kind):
            return (model._cross_entropy(z, t, kind) * m).sum()
        steps = {"head+CE": (mx.compile(mx.value_and_grad(lambda x, w: ce(x @ w.T), argnums=(0, 1))), (x, w)),
                 "CE only": (mx.compile(mx.value_and_grad(ce)), (logits,))}
        parts = []
        for name, (step, args) in steps.items():
            mx.eval(step(*args))
            mx.clear_cache()
            mx.reset_peak_memory()
            before = mx.get_active_memory()
            ms = _median_ms(lambda: mx.eval(step(*args)), a.repeats)
            parts.append(f"{name} {ms:7.2f} ms, peak {(mx.get_peak_memory() - before) / logit_bytes:.2f} logits")
        lines.append(f"mlx {kind:10s} " + "; ".join(parts))
    return lines


def torch_rows(a) -> list[str]:
    try:
        import numpy as np
        import torch
        import torch.nn.functional as F
    except ImportError:
        return ["torch: not installed"]
    torch.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((a.rows, a.dim)).astype(np.float32)).requires_grad_()
    w = torch.from_numpy((rng.standard_normal((a.vocab, a.dim)) * 0.02).astype(np.float32)).requires_grad_()
    t = torch.from_numpy(rng.integers(0, a.vocab, (a.rows,)))
    m = torch.from_numpy((rng.random(a.rows) > 0.1).astype(np.float32))
    logits = (x @ w.T).detach().requires_grad_()

    def head_ce():
        x.grad = w.grad = None
        (F.cross_entropy(x @ w.T, t, reduction="none") * m).sum().backward()

    def ce_only():
        logits.grad = None
        (F.cross_entropy(logits, t, reduction="none") * m).sum().backward()
    return [f"torch      head+CE {_median_ms(head_ce, a.repeats):7.2f} ms; CE only {_median_ms(ce_only, a.repeats):7.2f} ms"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--exp", default="auto", help="auto: the choice --mlx-exp auto makes at these shapes")
    parser.add_argument("--mlx-cpu-jit", default="auto")
    a = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    if os.environ.get(CHILD):
        for line in mlx_rows(a, os.environ[CHILD]) + torch_rows(a):
            print(line, flush=True)
        return
    from common.config import RunConfig
    from compare.machine.environment import mlx_blas, mlx_cpu_jit, thread_env
    from compare.machine.kernels import described

    seq = min(a.rows, 128)  # the exp is timed at the rows' shape: batch x seq is all that counts
    cfg = RunConfig(mlx_cpu_jit=a.mlx_cpu_jit, seq_len=seq, global_batch_size=max(1, a.rows // seq),
                    model={"dim": a.dim, "vocab_size": a.vocab})
    exp = a.exp if a.exp != "auto" else described(cfg, "exp")
    blas, env_blas = mlx_blas("auto")
    jit, env_jit = mlx_cpu_jit(a.mlx_cpu_jit, cfg.cache_path)
    print(f"BLAS: {blas}; fused CPU kernels: {jit}; exp: {exp}; {a.threads} thread(s); {a.rows} rows x dim {a.dim} "
          f"-> vocab {a.vocab}, float32; fwd+bwd, median of {a.repeats}, load {os.getloadavg()[0]:.1f}", flush=True)
    env = {**os.environ, **env_blas, **env_jit, **thread_env(a.threads), CHILD: exp.split()[0]}
    sys.exit(subprocess.call([sys.executable, *sys.argv], env=env))


if __name__ == "__main__":
    main()
