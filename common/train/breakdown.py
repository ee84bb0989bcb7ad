"""Where a step's time goes, measured the same way for both frameworks, after the run's timed steps.

Phases (seconds per optimizer step):
    data           batch assembly on the host: sampler, token reads, masks (the loop times it every step;
                   it is outside step_time_s)
    forward        forward pass and loss
    backward       gradients
    communication  the gradient reduction that is NOT hidden behind compute: per round, the step with
                   gradient sync minus the step without it (uninstrumented steps, so overlap such as DDP's
                   bucketed all-reduce during backward is credited)
    optimizer      clipping and the AdamW update
    other          the rest of the round: host overhead, casts, syncs (see `summarize`)
Each is the median over `--profile-steps` rounds, with its p10-p90 spread (`summarize`).
The forward/backward/optimizer split comes from instrumented steps: the Trainer's one `train_step`, run
without gradient sync, with wait=True (each phase forces the device to finish: mx.eval,
torch.cuda.synchronize) and `PhaseClock.phase` around each phase.
The sum of the phases (without data) is compared with uninstrumented steps taken in alternation with the
instrumented ones (`reference_step_s`; the run's own median step is `step_s`): the difference is what the
instrumentation itself costs plus what noise the rounds did not average out; beyond TOLERANCE the
breakdown says so (`within_tolerance`) and the report names the run (measurements: docs/profiling.md). Activation traffic of fsdp (all-gathers)
and tp (all-sums) happens inside forward and backward and is counted there.

These steps run after the last checkpoint and the final eval, so they change nothing a run reports
besides the breakdown itself.

Trainer interface used here: common/train/protocols.py's `Trainer` (train_step's sync, phase and wait).
"""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import numpy as np

PHASES = ("data", "forward", "backward", "communication", "optimizer", "other")
TOLERANCE = 0.15     # the phases must add up to the uninstrumented step within this share, or the breakdown says so
MIN_ROUNDS = 3       # measured rounds taken whatever the budget
BUDGET_S = 20.0      # after MIN_ROUNDS, no new round starts once profiling has taken this long


def profile(trainer, batches_for, steps: int, step_s: float, data_s: float, world_size: int,
            progress=lambda k: None, budget_s: float = BUDGET_S) -> dict:
    """`batches_for(k)` -> (batches, lr, global_tokens) of the k-th extra step; `progress(k)` after each
    step (a heartbeat for the watchdog). Up to `steps` rounds are measured, each one step of every kind,
    which alternate so that they see the same load; a round before them is not measured (a new variant may
    compile). After MIN_ROUNDS, no round starts once `budget_s` has passed (a big model's steps take
    seconds); every rank decides alike, from rank 0's clock under N > 1."""
    kinds = ["instrumented", "synced"] + (["unsynced"] if world_size > 1 else [])
    rounds, start = [], time.perf_counter()
    for k in range(steps + 1):
        if k > MIN_ROUNDS and _past_budget(trainer, world_size, time.perf_counter() - start > budget_s):
            break
        row = {}
        for i, kind in enumerate(kinds):
            args = batches_for(k * len(kinds) + i)
            if world_size > 1:  # start every measured step together: a rank left behind would count as comm
                trainer.all_sum(np.zeros(1), over="world")
            t0 = time.perf_counter()
            if kind == "instrumented":
                row.update(instrumented_step(trainer, args))
            else:
                trainer.train_step(*args, sync=kind == "synced")
                row[kind] = time.perf_counter() - t0
            progress(k * len(kinds) + i)
        if k:
            rounds.append(row)
    return {**summarize(rounds, step_s, data_s), "profile_steps_asked": steps}


def _past_budget(trainer, world_size: int, past: bool) -> bool:
    if world_size == 1:
        return past
    return bool(trainer.all_sum(np.array([float(past and trainer.rank == 0)]), over="world")[0])


def summarize(rounds: list[dict], step_s: float, data_s: float) -> dict:
    """Rounds of {"forward", "backward", "optimizer", "total", "synced"[, "unsynced"]} seconds -> the
    breakdown: each phase's median over the rounds and its p10-p90 spread, and whether the phases add up to
    the uninstrumented step within TOLERANCE (`within_tolerance`; the report says when they do not).

    Per round: communication = its synced step minus its unsynced one (paired: the two ran back to back
    under the same load; clipped at 0, which commutes with the median), and its sum = its instrumented
    total + its communication. forward, backward, optimizer and communication are medians over the rounds;
    other is the median over the rounds of each round's sum minus those four medians (host overhead, casts,
    syncs, and what a slow phase added to a round: max(0, .) commutes with the median). So the phases add up to the median round sum, not to
    the sum of per-phase medians: on a loaded machine a preempted step is slow in one phase of one round,
    the per-phase medians each drop such spikes, and their sum fell 6 to 14 % short of the median step
    under the same load (docs/profiling.md, "How far the phases are from the step")."""
    timed = ("forward", "backward", "optimizer")
    per = {p: [r[p] for r in rounds] for p in timed}
    per["communication"] = [max(0.0, r["synced"] - r["unsynced"]) if "unsynced" in r else 0.0 for r in rounds]
    sums = [r["total"] + c for r, c in zip(rounds, per["communication"])]
    synced = [r["synced"] for r in rounds]
    unsynced = [r["unsynced"] for r in rounds if "unsynced" in r]
    median = {p: float(np.median(per[p])) for p in (*timed, "communication")}
    # Each round's sum beyond the phases' medians: its median is `other`, its spread other's spread.
    per["other"] = [max(0.0, s - sum(median.values())) for s in sums]
    median["other"] = float(np.median(per["other"]))
    reference = float(np.median(synced))
    measured = sum(median.values())
    overhead = measured / reference - 1.0 if reference else None
    return {"data": data_s, **median, "step_s": step_s, "phases_sum_s": measured,
            # Uninstrumented steps taken alongside the instrumented ones: what the phases should add up to.
            "reference_step_s": reference, "instrumentation_overhead": overhead,
            "within_tolerance": overhead is not None and abs(overhead) <= TOLERANCE, "tolerance": TOLERANCE,
            # p10 and p90 over the rounds, per phase and for the uninstrumented
            # step: a difference inside these is not a real one.
            "spread": {**{p: [_pct(v, 10), _pct(v, 90)] for p, v in per.items()},
                       "reference_step_s": [_pct(synced, 10), _pct(synced, 90)]},
            "rounds": [{k: round(v, 6) for k, v in r.items()} for r in rounds],
            "profile_steps": len(rounds), "synced_step_s": reference,
            "unsynced_step_s": float(np.median(unsynced)) if unsynced else None}


def _pct(values, q) -> float:
    return float(np.percentile(values, q))


class PhaseClock:
    """Seconds per phase of one step, summed over its spans (forward and backward come once per
    micro-batch): the `phase` a Trainer's train_step takes."""

    def __init__(self):
        self.seconds = defaultdict(float)

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start


def instrumented_step(trainer, args) -> dict:
    """One step without gradient sync whose phases each wait for the device -> seconds of "forward",
    "backward", "optimizer" and the whole step, "total"."""
    clock, start = PhaseClock(), time.perf_counter()
    trainer.train_step(*args, sync=False, phase=clock.phase, wait=True)
    total = time.perf_counter() - start
    return {"forward": clock.seconds["forward"], "backward": clock.seconds["backward"],
            "optimizer": clock.seconds["optimizer"], "total": total}
