"""Where a step's time goes, measured the same way for both frameworks, after the run's timed steps.

Phases (seconds per optimizer step):
    data           batch assembly on the host: sampler, token reads, masks (the loop times it every step;
                   it is outside step_time_s)
    forward        forward pass and loss
    backward       gradients
    communication  the gradient reduction that is NOT hidden behind compute: the median step with
                   gradient sync minus the median step without it (uninstrumented steps, so overlap such
                   as DDP's bucketed all-reduce during backward is credited)
    optimizer      clipping and the AdamW update
    other          what the instrumented step spent outside those phases: host overhead, casts, syncs
The forward/backward/optimizer split comes from instrumented steps: the Trainer's one `train_step`, run
without gradient sync, with wait=True (each phase forces the device to finish: mx.eval,
torch.cuda.synchronize) and `PhaseClock.phase` around each phase.
The sum of the phases (without data) is compared with uninstrumented steps taken in alternation with the
instrumented ones (`reference_step_s`; the run's own median step is `step_s`): the difference is what the
instrumentation itself costs, and the report shows it. Activation traffic of fsdp (all-gathers)
and tp (all-sums) happens inside forward and backward and is counted there.

These steps run after the last checkpoint and the final eval, so they change nothing a run reports
besides the breakdown itself.

Trainer interface used here: common/protocols.py's `Trainer` (train_step's sync, phase and wait).
"""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import numpy as np

PHASES = ("data", "forward", "backward", "communication", "optimizer", "other")


def profile(trainer, batches_for, steps: int, step_s: float, data_s: float, world_size: int,
            progress=lambda k: None) -> dict:
    """`batches_for(k)` -> (batches, lr, global_tokens) of the k-th extra step; `progress(k)` after each
    step (a heartbeat for the watchdog). The three kinds of step alternate, so they see the same load,
    and each kind's first step is not measured: a new variant may compile."""
    instrumented, synced, unsynced = [], [], []
    kinds = ["instrumented", "synced"] + (["unsynced"] if world_size > 1 else [])
    for k in range(steps + 1):
        for i, kind in enumerate(kinds):
            args = batches_for(k * len(kinds) + i)
            if world_size > 1:  # start every measured step together: a rank left behind would count as comm
                trainer.all_sum(np.zeros(1), over="world")
            t0 = time.perf_counter()
            if kind == "instrumented":
                phases = instrumented_step(trainer, args)
            else:
                trainer.train_step(*args, sync=kind == "synced")
            elapsed = time.perf_counter() - t0
            progress(k * len(kinds) + i)
            if k:
                {"instrumented": instrumented, "synced": synced, "unsynced": unsynced}[kind].append(
                    phases if kind == "instrumented" else elapsed)
    synced_s = float(np.median(synced))
    communication = max(0.0, synced_s - float(np.median(unsynced))) if unsynced else 0.0
    median = {key: float(np.median([p[key] for p in instrumented])) for key in ("forward", "backward", "optimizer",
                                                                                 "total")}
    other = max(0.0, median["total"] - median["forward"] - median["backward"] - median["optimizer"])
    breakdown = {"data": data_s, "forward": median["forward"], "backward": median["backward"],
                 "communication": communication, "optimizer": median["optimizer"], "other": other}
    measured = sum(breakdown[p] for p in PHASES if p != "data")
    return {**breakdown, "step_s": step_s, "phases_sum_s": measured,
            # Uninstrumented steps taken alongside the instrumented ones: what the phases should add up to.
            "reference_step_s": synced_s,
            "instrumentation_overhead": measured / synced_s - 1.0 if synced_s else None,
            "profile_steps": steps, "synced_step_s": synced_s,
            "unsynced_step_s": float(np.median(unsynced)) if unsynced else None}


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
