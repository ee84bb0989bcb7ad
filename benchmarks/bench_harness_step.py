"""What dpcompare's Trainer adds per step over a bare loop, in one process, alternating step by step.

    python benchmarks/bench_harness_step.py --framework torch|mlx [--preset small] [--vocab 50257]
        [--seq-len 128] [--batch 8] [--steps 12] [--threads 2] [--norm float64-cast]

bench_overhead.py compares whole `dpcompare run`s with bare_torch.py / bare_mlx.py, run after run; on a
shared 2-core machine run-to-run swings (2x and more under others' jobs) hide a few percent. Here one
process builds both the Trainer (torch_impl/step.py or mlx_impl/step.py, 1 rank) and the bare loop's step
(the same model class, AdamW, clipping: bare_torch.py's and bare_mlx.py's code) and alternates them step by
step on the same random tokens, so both see the same load. Prints the median step of each, their ratio
(target: Trainer >= 0.97x the bare loop's tokens/s), and per-step medians of the pairs' differences.
`--norm float64-cast` (torch) puts back the gradient norm of before issue 27 (every gradient cast to
float64) to measure what it cost. The script re-runs itself in the environment a rank gets (threads;
MLX: OpenBLAS preloaded, --mlx-cpu-jit auto).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHILD = "DPCOMPARE_BENCH_HARNESS_CHILD"


def torch_steps(a, spec, weights, tokens):
    import torch
    import torch.nn.functional as F

    from common.config import RunConfig
    from common.train.loop import World
    from torch_impl import ddp
    from torch_impl.grads import norm_dtype
    from torch_impl.model import Llama, load_weights
    from torch_impl.step import Trainer

    torch.set_num_threads(a.threads)
    if a.norm == "float64-cast":
        def global_norm(self, grads):
            dtype = norm_dtype(self.device)
            return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=dtype) for g in grads]))
        ddp.Replicated.global_norm = global_norm
    cfg = RunConfig(framework="torch", preset=a.preset, seq_len=a.seq_len, global_batch_size=a.batch, lr=3e-4)
    trainer = Trainer(cfg, spec, weights, World(rank=0, size=1, group=None, device="cpu"))
    model = Llama(spec)
    load_weights(model, weights)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    mask = tokens[:, 1:] * 0 + 1

    def suite():
        trainer.train_step([(tokens[:, :-1], tokens[:, 1:], mask)], 3e-4, mask.size)

    def bare():
        x, y = torch.from_numpy(tokens[:, :-1]).long(), torch.from_numpy(tokens[:, 1:]).long()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()

    return suite, bare


def mlx_steps(a, spec, weights, tokens):
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim

    from common.config import RunConfig
    from common.train.loop import World
    from mlx_impl.model import Llama, load_weights
    from mlx_impl.step import Trainer, cross_entropy

    cfg = RunConfig(framework="mlx", preset=a.preset, seq_len=a.seq_len, global_batch_size=a.batch, lr=3e-4)
    trainer = Trainer(cfg, spec, weights, World(rank=0, size=1, group=None, device="cpu"))
    model = Llama(spec)
    load_weights(model, weights)
    optimizer = optim.AdamW(learning_rate=3e-4, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.1)
    loss_and_grad = nn.value_and_grad(model, lambda m, x, y: cross_entropy(m(x), y).mean())
    state = [model.state, optimizer.state]

    def step(x, y):
        loss, grads = loss_and_grad(model, x, y)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(model, grads)
        return loss

    step = mx.compile(step, inputs=state, outputs=state)
    mask = (tokens[:, 1:] * 0 + 1).astype("float32")

    def suite():
        trainer.train_step([(tokens[:, :-1], tokens[:, 1:], mask)], 3e-4, mask.size)

    def bare():
        loss = step(mx.array(tokens[:, :-1]), mx.array(tokens[:, 1:]))
        mx.eval(loss, state)
        loss.item()

    return suite, bare


def main_child(a) -> None:
    import numpy as np

    sys.path.insert(0, str(ROOT))
    from common.model.spec import preset
    from common.model.weights import init_weights

    spec = preset(a.preset).with_(vocab_size=a.vocab)
    weights = init_weights(spec, 0)
    tokens = np.random.default_rng(0).integers(0, a.vocab, (a.batch, a.seq_len + 1)).astype(np.int32)
    suite, bare = (torch_steps if a.framework == "torch" else mlx_steps)(a, spec, weights, tokens)
    times = {"suite": [], "bare": []}
    for k in range(a.steps + 3):
        for name, fn in (("suite", suite), ("bare", bare)) if k % 2 else (("bare", bare), ("suite", suite)):
            t0 = time.perf_counter()
            fn()
            if k >= 3:  # warmup: compile, first allocations
                times[name].append(time.perf_counter() - t0)
    s, b = np.median(times["suite"]), np.median(times["bare"])
    diffs = np.subtract(times["suite"], times["bare"])
    print(f"{a.framework} {a.preset} seq {a.seq_len} batch {a.batch} {a.threads} thread(s), norm {a.norm}: "
          f"Trainer {1e3 * s:.1f} ms, bare {1e3 * b:.1f} ms per step (medians of {a.steps}); "
          f"Trainer/bare tokens/s {b / s:.3f}; per-pair difference median {1e3 * np.median(diffs):+.1f} ms "
          f"[p10 {1e3 * np.percentile(diffs, 10):+.1f}, p90 {1e3 * np.percentile(diffs, 90):+.1f}]", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=("torch", "mlx"), required=True)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--norm", choices=("current", "float64-cast"), default="current")
    a = parser.parse_args()
    if os.environ.get(CHILD):
        return main_child(a)
    sys.path.insert(0, str(ROOT))
    from compare.machine.environment import mlx_blas, mlx_cpu_jit, thread_env
    env = {**os.environ, **thread_env(a.threads), CHILD: "1"}
    if a.framework == "mlx":
        env.update(mlx_blas("auto")[1])
        env.update(mlx_cpu_jit("auto", Path.home() / ".cache" / "dpcompare")[1])
    sys.exit(subprocess.call([sys.executable, *sys.argv], env=env))


if __name__ == "__main__":
    main()
