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
The forward/backward/optimizer split comes from instrumented steps that force the device to finish each
phase before the next starts (mx.eval, torch.cuda.synchronize / .item()) and skip the gradient sync.
The sum of the phases (without data) is compared with the run's own median step time: the difference is
what the instrumentation itself costs, and the report shows it. Activation traffic of fsdp (all-gathers)
and tp (all-sums) happens inside forward and backward and is counted there.

These steps run after the last checkpoint and the final eval, so they change nothing a run reports
besides the breakdown itself.

Trainer interface used here:
    .train_step(batches, lr, global_tokens, sync=True)   sync=False skips the gradient reduction
    .profile_step(batches, lr, global_tokens)            -> {"forward", "backward", "optimizer", "total"} seconds,
                                                             without gradient sync
"""
from __future__ import annotations

import time

import numpy as np

PHASES = ("data", "forward", "backward", "communication", "optimizer", "other")


def profile(trainer, batches_for, steps: int, step_s: float, data_s: float, world_size: int,
            progress=lambda k: None) -> dict:
    """`batches_for(k)` -> (batches, lr, global_tokens) of the k-th extra step; `progress(k)` after each
    step (a heartbeat for the watchdog). One unmeasured step of each kind first: a new variant may compile."""
    instrumented = []
    for k in range(steps + 1):
        phases = trainer.profile_step(*batches_for(k))
        progress(k)
        if k:
            instrumented.append(phases)
    communication, synced, unsynced = 0.0, [], []
    if world_size > 1:
        for k in range(steps + 1):
            for sync, times in ((True, synced), (False, unsynced)):  # alternating: both see the same load
                args = batches_for(steps + 1 + k)
                t0 = time.perf_counter()
                trainer.train_step(*args, sync=sync)
                progress(steps + 1 + 2 * k + (not sync))
                if k:
                    times.append(time.perf_counter() - t0)
        communication = max(0.0, float(np.median(synced)) - float(np.median(unsynced)))
    median = {key: float(np.median([p[key] for p in instrumented])) for key in ("forward", "backward", "optimizer",
                                                                                 "total")}
    other = max(0.0, median["total"] - median["forward"] - median["backward"] - median["optimizer"])
    breakdown = {"data": data_s, "forward": median["forward"], "backward": median["backward"],
                 "communication": communication, "optimizer": median["optimizer"], "other": other}
    measured = sum(breakdown[p] for p in PHASES if p != "data")
    return {**breakdown, "step_s": step_s, "phases_sum_s": measured,
            "instrumentation_overhead": (measured / step_s - 1.0) if step_s else None,
            "profile_steps": steps, "synced_step_s": float(np.median(synced)) if synced else None,
            "unsynced_step_s": float(np.median(unsynced)) if unsynced else None}
