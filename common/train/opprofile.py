"""The op-class profile: after a 1-rank run's training, the model's op classes (common/train/opclasses.py) timed
one by one at the run's own shapes, beside uninstrumented training steps, the same way in both frameworks.

The backend hands the workloads (Trainer.op_workloads: {class: [(run once and wait, times per step)]},
{mlx,torch}_impl/opclasses.py); this loop times them. A rep runs one training step (the reference, what the
classes should add up to), then every class's workloads, each call ending when the device is done (mx.eval; a
CUDA sync); a class's time per step is the sum of its workloads' times, each times how often a step runs it
(per layer, per micro-batch). Every workload runs once first, not measured (new functions compile); then MIN_REPS
reps, and up to MAX_REPS while the profile has taken less than BUDGET_S. Each class's figure is its median over the reps.

The classes must add up to the reference step within TOLERANCE (`within_tolerance`); the rest is `outside_s`
(opclasses.OUTSIDE says what it holds). Measured on configs/demo.toml: docs/profiling.md, "The op classes".
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from common.model.lora import FullModel, Trained
from common.train.opclasses import OP_CLASSES, OUTSIDE, class_work

TOLERANCE = 0.15     # the classes must add up to the reference step within this share, or the record says so
MIN_REPS = 3         # measured reps taken whatever the budget
MAX_REPS = 5
BUDGET_S = 0.5       # after MIN_REPS, no new rep starts once the profile has taken this long (~1 s a run at demo)
BANDWIDTH_BYTES = 64 << 20   # larger than a last-level cache: what streaming from memory reaches

Workloads = dict[str, list[tuple[Callable[[], None], int]]]


def profile(trainer, step_args, spec, micro_batch: int, seq_len: int, grad_accum: int, dtype: str,
            progress: Callable[[int], None] = lambda k: None, budget_s: float = BUDGET_S,
            trained: Trained = FullModel()) -> dict:
    """`step_args` = (batches, lr, global_tokens) of one training step; its first batch sets the workloads'
    shapes; `trained` what the step trains (common/model/lora.py), for the classes' work. -> the op-class record
    of summary.json's `op_profile` (see `summarize`)."""
    start = time.perf_counter()
    batches, lr, global_tokens = step_args
    workloads: Workloads = trainer.op_workloads(batches[0], grad_accum)
    built = time.perf_counter()
    for parts in workloads.values():  # not measured: new functions compile (the training step is warm)
        for fn, _ in parts:
            fn()
    warm = time.perf_counter()
    reps: list[dict] = []
    for k in range(MAX_REPS):
        if k >= MIN_REPS and time.perf_counter() - start > budget_s:
            break
        # The reference is the second of two steps: the first after the classes' workloads ran on their own
        # tensors (caches and the allocator's free lists theirs) took 15-25 % longer than a training step.
        trainer.train_step(batches, lr, global_tokens)
        t0 = time.perf_counter()
        trainer.train_step(batches, lr, global_tokens)
        row = {"reference_step_s": time.perf_counter() - t0}
        for name, parts in workloads.items():
            row[name] = sum(times * _timed(fn) for fn, times in parts)
        reps.append(row)
        progress(k)
    work = class_work(spec, micro_batch, seq_len, grad_accum, dtype, trained)
    bandwidth = memory_bandwidth_Bps()
    return {**summarize(reps, work), "memory_bandwidth_Bps": bandwidth,
            "shapes": {"micro_batch": micro_batch, "seq_len": seq_len, "grad_accum": grad_accum, "dtype": dtype},
            # what the profile cost the run: building the workloads, their first (compiling) calls, all of it
            "build_s": built - start, "warmup_s": warm - built, "wall_s": time.perf_counter() - start}


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def summarize(reps: list[dict], work: dict) -> dict:
    """Reps of {class: seconds per step, "reference_step_s"} -> {classes: {class: {s, spread, flops, bytes}},
    class_sum_s, reference_step_s, outside_s, outside_share, within_tolerance, ...}: medians over the reps,
    p10-p90 spreads. class_sum_s is the median of each rep's sum of its classes, not the sum of the classes'
    medians: on a loaded machine a preempted call is slow in one class of one rep, each class's median drops
    such spikes, and a step, as long as all the classes together, keeps them about as often as a rep's sum does
    (the time breakdown measured the same bias, docs/profiling.md). outside_s and outside_share are medians of
    each rep's own difference, step minus its classes; `rounds` keeps every rep's figures."""
    classes = {}
    for name in OP_CLASSES:
        values = [r[name] for r in reps if name in r]
        if values:
            classes[name] = {"s": float(np.median(values)), "spread": [_pct(values, 10), _pct(values, 90)],
                             **work.get(name, {})}
    reference = [r["reference_step_s"] for r in reps]
    step = float(np.median(reference)) if reference else 0.0
    sums = [sum(r[name] for name in classes if name in r) for r in reps]
    total = float(np.median(sums)) if reps else 0.0
    # Paired: each rep's step minus its own classes, which ran right after it under the same load (the load of a
    # shared machine drifts over seconds, more than a rep lasts).
    outside = float(np.median([ref - s for ref, s in zip(reference, sums)])) if reps else 0.0
    share = float(np.median([(ref - s) / ref for ref, s in zip(reference, sums)])) if reps and min(reference) > 0 \
        else None
    return {"classes": classes, "class_sum_s": total, "reference_step_s": step,
            "reference_spread": [_pct(reference, 10), _pct(reference, 90)] if reference else None,
            "outside_s": outside, "outside_share": share, "outside": OUTSIDE,
            "within_tolerance": share is not None and abs(share) <= TOLERANCE, "tolerance": TOLERANCE,
            "reps": len(reps), "rounds": [{k: round(v, 6) for k, v in r.items()} for r in reps],
            "measured": "forward and backward of each class at the run's shapes (per layer, times the layers; "
                        "per micro-batch, times grad_accum), the optimizer once; each call waits for the device; "
                        "median over the reps, beside uninstrumented training steps"}


def _pct(values, q) -> float:
    return float(np.percentile(values, q))


def memory_bandwidth_Bps(nbytes: int = BANDWIDTH_BYTES, repeats: int = 3) -> float:
    """Bytes per second a one-thread copy streams (read + write) through memory, best of `repeats`: the
    memory-bound classes' floor (numpy, so the same figure for both frameworks)."""
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * src.nbytes / best
