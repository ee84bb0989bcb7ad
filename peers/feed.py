"""What every peer shares, framework-free: the run plan, dpcompare's batches for each step (rank r's share of the
global batch, as common/train/loop.py's `Run.step_inputs` gives mlx_impl and torch_impl), and the run directory's
files (metrics.jsonl from rank 0, ranks/rank{R}.json from every rank), so the runner's summary.json and the report
read a peer's run like any other.

A peer never trains through a loop of ours: `Feed.batches(step)` is what its own trainer's extension point yields
(mlx-lm's `iterate_batches`, the Trainer's dataloader), and `Feed.record` is called from its own callback.
"""
from __future__ import annotations

import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from common.config import RunConfig
from common.data.sampler import GlobalSampler, micro_batches, sampler_for
from common.data.sequences import SequenceView
from common.data.tokencache import TokenCache
from common.errors import UserError
from common.metrics import MetricsWriter, RankStatus, peak_rss_bytes, rss_bytes, truncate_metrics
from common.runplan import RunPlan
from common.train.lr_schedule import lr_for


@dataclass
class Feed:
    run_dir: Path
    plan: RunPlan
    rank: int
    world_size: int
    status: RankStatus
    metrics: MetricsWriter
    view: SequenceView
    sampler: GlobalSampler
    launch_time: float = field(default_factory=lambda: float(os.environ.get("DPCOMPARE_LAUNCH_TIME", time.time())))
    step_times: list[float] = field(default_factory=list)
    first_step_end: float | None = None

    @property
    def cfg(self) -> RunConfig:
        return self.plan.config

    @classmethod
    def open(cls, run_dir: Path, rank: int, world_size: int) -> "Feed":
        plan = RunPlan.read(run_dir)
        cfg = plan.config
        status = RankStatus(run_dir, rank)
        status.update(force=True, fixed_rss_bytes=rss_bytes())
        cache = TokenCache.open(plan.token_cache)
        view = SequenceView(cache.split("train"), cfg.seq_len, cfg.sequence, mask_prompt=cfg.mask_prompt,
                            mask_convention=cfg.mask_convention, padding_rule=cfg.padding_rule)
        sampler = sampler_for(cfg.data_order, view.num_samples, cfg.global_batch_size, cfg.seed, view.sample_lengths)
        if rank == 0:
            truncate_metrics(Path(run_dir) / "metrics.jsonl", 0)
        metrics = MetricsWriter(Path(run_dir) / "metrics.jsonl", enabled=rank == 0)
        return cls(Path(run_dir), plan, rank, world_size, status, metrics, view, sampler)

    def batches(self, step: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """This rank's micro-batches (inputs, targets, mask) of optimizer step `step` (0-based): the loop's."""
        indices = self.sampler.global_batch_indices(step)
        mine = self.sampler.rank_part(indices, self.rank, self.world_size)
        return [self.view.batch(m) for m in micro_batches(mine, self.cfg.grad_accum)]

    def global_tokens(self, step: int) -> int:
        return self.view.real_target_count(self.sampler.global_batch_indices(step))

    def lr(self, step: int) -> float:
        return lr_for(self.cfg, step)

    def record(self, step: int, loss: float, grad_norm: float | None, step_time_s: float,
               lr: float | None = None) -> None:
        """Step `step` (1-based) as the peer's own trainer reported it (its lr too, where it says): metrics.jsonl's
        row, the status heartbeat."""
        self.step_times.append(step_time_s)
        if self.first_step_end is None:
            self.first_step_end = time.time()
            self.status.update(force=True, first_step_end=self.first_step_end)
        tokens = self.global_tokens(step - 1)
        self.metrics.write({"step": step, "loss": float(loss), "lr": self.lr(step - 1) if lr is None else float(lr),
                            "grad_norm": None if grad_norm is None else float(grad_norm), "tokens": tokens,
                            "step_time_s": step_time_s, "tokens_per_s": tokens / step_time_s if step_time_s else None,
                            "epoch": self.sampler.epoch_of(step - 1), "strategy": self.cfg.strategy})
        self.status.update(step=step, loss=float(loss), status="running")

    def finish(self, peak_mem_bytes: int | None, state_bytes: dict, eval_loss: float | None = None) -> None:
        if eval_loss is not None:
            self.metrics.write({"step": len(self.step_times), "eval_loss": float(eval_loss)})
        self.metrics.close()
        warm = self.cfg.timing_warmup_steps
        timed = self.step_times[warm:] or self.step_times
        median = float(np.median(timed)) if timed else 0.0
        self.status.update(
            force=True, status="ok", peak_mem_bytes=peak_mem_bytes, peak_rss_bytes=peak_rss_bytes(),
            state_bytes=state_bytes, steps_run=len(self.step_times),
            compile_s=max(0.0, sum(self.step_times[:warm]) - median * min(len(self.step_times), warm)),
            time_to_first_step_s=(self.first_step_end - self.launch_time) if self.first_step_end else None)


def peer_main(run_dir: str, rank: int, body: Callable[[], None]) -> int:
    """Run a peer's rank; a failure lands in ranks/rank{r}.json and one line on stderr (as common/train/loop.py's
    rank_main does for the backends)."""
    try:
        body()
        return 0
    except BaseException as err:  # noqa: BLE001 - the launcher must learn of every failure
        message = str(err) if isinstance(err, UserError) else f"{type(err).__name__}: {err}"
        try:
            RankStatus.existing(Path(run_dir), rank).update(force=True, status="failed", error=message,
                                                             traceback=traceback.format_exc()[-4000:])
        except OSError:
            pass
        print(f"rank {rank}: {message}", file=sys.stderr, flush=True)
        return 2 if isinstance(err, UserError) else 1
