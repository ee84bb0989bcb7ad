"""`auto` for MLX's selectable CPU kernels, decided by timing the candidates here (common/kernels.py decides and
caches, this file times).

- exp (--mlx-exp): the model's own compiled softmax (kernels._SOFTMAX) with mx.exp and with the fused exp
  (fast_exp.py), over float32 scores of the run's attention shape: the same kernels the step compiles, so their
  build is shared with it.
- bf16 matmul (--mlx-bf16-matmul): x @ W^T in bfloat16 by MLX's own kernel, and the fp32 route (model.matmul:
  exact upcast, the BLAS's sgemm, one rounding), at the MLP's up-projection shape.
- cross-entropy's shift (model.set_cross_entropy): the model's cross-entropy, forward and backward compiled, with
  each form of its row max and shift and the run's exp, over float32 logits of the run's (tokens, vocabulary).

- attention (model.set_attention): the model's float32 attention core, forward and backward compiled, whole or in
  blocks of queries, at the run's (micro-batch, heads, kv heads, seq, head dim) with the run's exp, the micro-batch
  cut to about MAX_SCORES scores (the blocks win where the scores outgrow the cache, so the cut keeps that size).

Each candidate runs once to build its kernels, then they alternate and the minimum per call counts; the shapes
are cut to about a few million elements (a few tens of ms per call at worst), so a measurement takes well under a
second. The launcher measures first in a child with the ranks' environment (`python -m mlx_impl.kernel_choice`,
compare/machine/kernels.py) so that every rank reads the same cached choice; a rank that finds none (another
host) measures itself.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from common.config import RunConfig, default_cache_dir
from common.costmodel.probed import ProbeRequest
from common.kernels import CANDIDATES, Identity, KernelCache, attention_shape, fixed_choice, measured_shape, measures
from common.model.spec import ModelSpec

from . import attention, kernels, model

MAX_EXP_ELEMENTS = 4 * 2**20          # scores cut to about 4M elements (a few ms per call with either exp)
MAX_LOGITS = 4 * 2**20               # logits cut to about 4M (about 40 ms per call at a 50k vocabulary)
MAX_MATMUL_MACS = 64 * 2**20          # rows cut to about 64M multiply-adds (13 ms at MLX's own 5 GFLOP/s)
MAX_SCORES = 4 * 2**20               # attention cut to about 4M scores (16 MB: past a 4 MB L2; ~80 ms a call)
ROUNDS = 5


CPU_SHARE: dict[str, float | None] = {"last": None}  # the last timing's CPU time over its wall time (common/kernels.py was_contended)


def _min_time_s(functions: dict, args: tuple) -> dict[str, float]:
    for f in functions.values():  # build (g++, in a child: not this process's CPU time) and warm every candidate
        mx.eval(f(*args))
    best = {name: math.inf for name in functions}
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(ROUNDS):
        for name, f in functions.items():  # alternating, so a burst of load hits both
            start = time.perf_counter()
            mx.eval(f(*args))
            best[name] = min(best[name], time.perf_counter() - start)
    CPU_SHARE["last"] = (time.process_time() - cpu) / max(time.perf_counter() - wall, 1e-9)
    return best


def time_exp(shape: tuple[int, ...]) -> dict[str, float]:
    """ns per element of the model's compiled softmax with each exp, at `shape` (cut to MAX_EXP_ELEMENTS)."""
    shape = _cut(shape, MAX_EXP_ELEMENTS)
    scores = mx.array(np.random.default_rng(0).standard_normal(shape).astype(np.float32))
    mx.eval(scores)
    best = _min_time_s({kind: kernels._SOFTMAX[kind] for kind in CANDIDATES["exp"]}, (scores,))
    return {kind: 1e9 * t / scores.size for kind, t in best.items()}


def time_bf16_matmul(shape: tuple[int, ...]) -> dict[str, float]:
    """ps per multiply-add of a bfloat16 x @ W^T (W float32, cast at use as Linear does) with each
    route, at (rows, in, out) = `shape`, rows cut to MAX_MATMUL_MACS."""
    rows, n_in, n_out = shape
    rows = max(1, min(rows, MAX_MATMUL_MACS // max(1, n_in * n_out)))
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((rows, n_in)).astype(np.float32)).astype(mx.bfloat16)
    w = mx.array(rng.standard_normal((n_out, n_in)).astype(np.float32))
    mx.eval(x, w)

    def route(kind: str):
        return mx.compile(lambda x, w: model.matmul(x, w.astype(x.dtype).T, kind))

    best = _min_time_s({kind: route(kind) for kind in CANDIDATES["bf16_matmul"]}, (x, w))
    return {kind: 1e12 * t / (rows * n_in * n_out) for kind, t in best.items()}


def time_cross_entropy(shape: tuple[int, ...]) -> dict[str, float]:
    """ns per logit of the model's cross-entropy, forward and backward compiled (as the step computes it), with
    each shift, at (tokens, vocabulary, the exp's index in CANDIDATES["exp"]) = `shape`, tokens cut to MAX_LOGITS."""
    rows, vocab, exp_index = shape
    rows = max(1, min(rows, MAX_LOGITS // max(1, vocab)))
    rng = np.random.default_rng(0)
    logits = mx.array(rng.standard_normal((rows, vocab)).astype(np.float32))
    targets = mx.array(rng.integers(0, vocab, rows).astype(np.int32))
    mx.eval(logits, targets)
    exp = CANDIDATES["exp"][exp_index]

    def form(kind: str):
        return mx.compile(mx.value_and_grad(lambda x, t: model._cross_entropy(x, t, kind, exp).sum()))

    best = _min_time_s({kind: form(kind) for kind in CANDIDATES["cross_entropy"]}, (logits, targets))
    return {kind: 1e9 * t / (rows * vocab) for kind, t in best.items()}


def time_attention(shape: tuple[int, ...]) -> dict[str, float]:
    """ns per score (B x H x T x T) of the model's float32 attention core, forward and backward compiled, with each
    block count, at (micro-batch, heads, kv heads, seq, head dim, the exp's index) = `shape`, the micro-batch cut
    to MAX_SCORES."""
    rows, heads, kv_heads, seq, head_dim, exp_index = shape
    rows = max(1, min(rows, MAX_SCORES // max(1, heads * seq * seq)))
    rng = np.random.default_rng(0)
    q, k, v, cot = (mx.array(rng.standard_normal((rows, h, seq, head_dim)).astype(np.float32))
                    for h in (heads, kv_heads, kv_heads, heads))
    mx.eval(q, k, v, cot)
    before = attention._ATTENTION["kind"], kernels._EXP["kind"]
    model.set_exp(CANDIDATES["exp"][exp_index])

    def form(kind: str):
        def loss(q, k, v):
            model.set_attention(kind)  # read while the step is traced, at its first call
            return (model.attention(q, k, v, head_dim ** -0.5, "causal") * cot).sum()
        return mx.compile(mx.value_and_grad(loss, argnums=(0, 1, 2)))

    try:
        best = _min_time_s({kind: form(kind) for kind in CANDIDATES["attention"]}, (q, k, v))
    finally:  # the process's own choices stay as they were
        model.set_attention(before[0])
        model.set_exp(before[1])
    return {kind: 1e9 * t / (rows * heads * seq * seq) for kind, t in best.items()}


TIMERS = {"exp": time_exp, "bf16_matmul": time_bf16_matmul, "cross_entropy": time_cross_entropy,
          "attention": time_attention}


def _cut(shape: tuple[int, ...], most: int) -> tuple[int, ...]:
    """`shape` with its leading axes shrunk until it holds at most `most` elements (the rows stay whole)."""
    dims = list(shape)
    for axis in range(len(dims) - 1):
        while dims[axis] > 1 and math.prod(dims) > most:
            dims[axis] = (dims[axis] + 1) // 2
    return tuple(dims)


def measured(cache_root: Path, identity: Identity, kernel: str, shape: tuple[int, ...], contended: bool = True) -> dict:
    """The cache entry of `kernel` at `shape` (its timings and choice); timed here and stored on a miss. A rank
    takes an entry its launcher timed while the CPU was shared (contended=True: the ranks agree with it); the
    launcher's child (main) times such an entry again."""
    cache = KernelCache(cache_root)
    entry = cache.get(identity, kernel, shape, contended)
    if entry is not None:
        return entry
    timings = TIMERS[kernel](shape)
    return cache.put(identity, kernel, shape, timings, CPU_SHARE["last"])


def choice_for(cfg: RunConfig, spec: ModelSpec, kernel: str) -> tuple[str, dict | None]:
    """(the candidate `kernel` runs with in this process, its cache entry or None where nothing was measured)."""
    device = "gpu" if mx.default_device() == mx.gpu else "cpu"
    chosen = fixed_choice(cfg, kernel, device, sys.platform)
    if chosen is not None:
        return chosen, None
    exp = choice_for(cfg, spec, "exp")[0] if kernel in ("cross_entropy", "attention") else "native"  # the run's exp
    entry = measured(cfg.cache_path, Identity.here(cfg.mlx_cpu_jit), kernel, measured_shape(cfg, kernel, spec, exp))
    return entry["choice"], entry


def probe_attention(req: ProbeRequest) -> str:
    """The block probe's attention blocks (mlx_impl/block_probe.py): as asked, or under "auto" the ones a run
    takes on this CPU in float32, timed at the probe's rows and cached as a rank's choice is."""
    if req.attention != "auto":
        return req.attention
    if req.dtype != "float32" or mx.default_device() == mx.gpu or not measures("cpu", sys.platform):
        return CANDIDATES["attention"][0]
    shape = attention_shape(req.rows, req.seq_len, req.spec, req.exp)
    return measured(default_cache_dir(), Identity.here("auto"), "attention", shape)["choice"]


def main() -> int:
    """The launcher's child: `--measure KERNEL=D1,D2,...` for each kernel, cached in $DPCOMPARE_CACHE (the
    run's cache folder); one JSON line {kernel: entry} out."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mlx-cpu-jit", default="auto")
    parser.add_argument("--measure", action="append", default=[], metavar="KERNEL=SHAPE")
    args = parser.parse_args()
    identity, out = Identity.here(args.mlx_cpu_jit), {}
    for item in args.measure:
        kernel, _, dims = item.partition("=")
        out[kernel] = measured(default_cache_dir(), identity, kernel, tuple(int(d) for d in dims.split(",")),
                               contended=False)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    from common.train.process_exit import exit_now

    exit_now(main())  # no interpreter teardown: 1-1.5 s of a torch process (common/train/process_exit.py)
