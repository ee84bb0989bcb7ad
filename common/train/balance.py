"""`--rank-shares auto` (docs/uneven.md): before the first step every data-parallel rank times a forward of its even
share of that step's batch, the ranks sum the timings, and each sets the same shares from them, in proportion to the
measured speeds (common/data/shares.py speeds_to_shares). Forward only, through the Trainer's eval (no gradient, no
update, no state touched), so the run's losses stay what they would be with those shares given by hand; under
global-tokens any shares compute what one rank computes."""
from __future__ import annotations

import time

import numpy as np

from common.data.sampler import micro_batches
from common.data.shares import AUTO, speeds_to_shares

MIN_TIMED_S = 0.3   # repeat the forward until this long, so a duty cycle's 20 ms windows (--rank-speed) average out
MAX_REPEATS = 50


def balanced(run):
    """`run` (common/train/loop.py Run) with its config's auto shares replaced by measured ones."""
    cfg = run.cfg
    if cfg.rank_shares != AUTO or run.dp_size < 2:
        return run
    indices = run.sampler.global_batch_indices(run.start_step)
    mine = run.sampler.rank_part(indices, run.dp_rank, run.dp_size)
    batches = [run.train_view.batch(m) for m in micro_batches(mine, cfg.grad_accum)]
    for batch in batches:  # compiles, warms the caches
        run.trainer.eval_loss_sum(*batch)
    repeats, start = 0, time.perf_counter()
    while repeats < MAX_REPEATS and (repeats < 3 or time.perf_counter() - start < MIN_TIMED_S):
        for batch in batches:
            run.trainer.eval_loss_sum(*batch)
        repeats += 1
    timings = np.zeros(run.dp_size, dtype=np.float64)
    timings[run.dp_rank] = (time.perf_counter() - start) / repeats
    forward_s = [float(t) for t in run.trainer.all_sum(timings, over="data")]
    sizes = speeds_to_shares(forward_s, cfg.global_batch_size, cfg.grad_accum)
    run.cfg = cfg.replace(rank_shares=",".join(str(n) for n in sizes))
    run.status.update(force=True, auto_shares={"forward_s": forward_s, "rank_batch_sizes": list(sizes),
                                               "repeats": repeats})
    return run
