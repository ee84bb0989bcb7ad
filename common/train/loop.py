"""The training loop's bookkeeping, shared by both backends.

A backend supplies a `Trainer` (its `step.py`) that owns the model, optimizer and collectives; this loop
owns everything else: which samples each rank reads, the global token count that makes the loss exact,
the LR at each step, timing, metrics, eval, checkpoints, resume and the rank's status file.

Trainer interface: common/train/protocols.py's `Trainer` (mlx_impl/step.py and torch_impl/step.py implement it).
"""
from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from common.train.placement import pinned_cores, rank_from_environment
from common.train.balance import balanced
from common.train.breakdown import profile
from common.train.opprofile import profile as op_profile
from common.checkpoint.store import (latest_checkpoint, open_checkpoint,
                         resume_fingerprints)
from common.config import RunConfig
from common.errors import UserError
from common.costmodel.probe import probe_allreduce, probe_group_allreduce
from common.metrics import MetricsWriter, RankStatus, peak_rss_bytes, rss_bytes, truncate_metrics
from common.runplan import RunPlan
from common.train.protocols import Trainer, TrainerClass, World
from common.data.sampler import GlobalSampler, micro_batches, sampler_for
from common.train.lr_schedule import lr_for
from common.data.sequences import SequenceView
from common.model.spec import ModelSpec
from common.train.supervisor import stop_reason, watch_supervisor
from common.data.tokencache import TokenCache
from common.checkpoint.tensorsource import DictSource, SafetensorsSource, UnionSource, check_source, probe_checksum
from common.train.rank_checks import (TrainingError, check_identical_weights, check_same_step)
from common.train.trace import trace
from common.train.faults import Fault, injected_fault
from common.train.rescue import Rescue, copy_state, saver
from common.train.saving import CHECKPOINT_WRITERS, checkpoint  # noqa: F401 (checkpoint: tests)


# This rank's status, once training has started: a failure is recorded with the step reached so far.
_live_status: RankStatus | None = None
# ddp with --max-restarts: the last completed step, which a survivor saves when a peer is lost (rescue.py).
_rescue: Rescue | None = None


def rank_main(run_dir: str, start_world: Callable[[RunConfig], World], trainer_cls: TrainerClass) -> int:
    """Run one rank; every failure lands in ranks/rank{r}.json and one line on stderr, never a hang.

    `start_world(cfg) -> World` initialises the framework's distributed state (the only part that
    differs between backends besides the Trainer).
    """
    rank = rank_from_environment()

    def on_sigterm(signum, frame):
        # Launchers SIGTERM the survivors when a rank dies; say so, so the watchdog blames the right rank.
        # But when dpcompare itself was stopped (ranks/stop.json) or is gone, this is no failure.
        reason = stop_reason(Path(run_dir))
        (_live_status or RankStatus.existing(Path(run_dir), rank)).update(
            force=True, **({"status": "interrupted", "error": f"stopped: {reason}"} if reason else
                           {"status": "failed", "error": "terminated by SIGTERM (the launcher stops the job when "
                                                         "a peer fails)"}))
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    def on_supervisor_gone():
        # Nobody is left to stop this job (dpcompare was SIGKILLed): end it from here, even mid-collective.
        # A checkpoint being saved is abandoned in its temporary directory; `latest` stays complete.
        try:
            (_live_status or RankStatus.existing(Path(run_dir), rank)).update(
                force=True, status="interrupted", error=f"stopped: {stop_reason(run_dir)}")
            print(f"rank {rank}: {stop_reason(run_dir)}; exiting", file=sys.stderr, flush=True)
        finally:
            os._exit(1)

    signal.signal(signal.SIGTERM, on_sigterm)
    watch_supervisor(on_supervisor_gone)
    try:
        world = start_world(RunPlan.read(Path(run_dir)).config)
        rank = world.rank
        train(Path(run_dir), world, trainer_cls)
        return 0
    except BaseException as err:  # noqa: BLE001 - the launcher must learn of every failure
        message = f"{type(err).__name__}: {err}" if not isinstance(err, UserError) else str(err)
        if isinstance(err, KeyboardInterrupt):
            message = "interrupted"
        status = _live_status or RankStatus.existing(Path(run_dir), rank)
        reason = stop_reason(Path(run_dir))  # a peer stopped by dpcompare makes this rank's collective fail
        try:
            status.update(force=True, status="interrupted" if reason else "failed",
                          error=f"stopped: {reason} ({message})" if reason else message,
                          traceback=traceback.format_exc()[-4000:])
        except OSError:  # a full disk: the launcher sees a rank gone without a word, and the disk full
            pass
        print(f"rank {rank}: {message}", file=sys.stderr, flush=True)
        if _rescue is not None and not reason:  # the launcher may ask this rank to save its last step
            _rescue.linger()
        return 2 if isinstance(err, UserError) else 1


@dataclass
class Run:
    """One rank's run from setup to finish: what the loop reads, and the times it measures on the way."""
    run_dir: Path
    cfg: RunConfig
    spec: ModelSpec
    trainer: Trainer
    status: RankStatus
    metrics: MetricsWriter
    train_view: SequenceView
    valid_view: SequenceView | None
    sampler: GlobalSampler
    fingerprints: dict           # what a checkpoint must share with a run resuming it
    dp_rank: int                 # data-parallel rank and size (common/parallel/layout.py): tp ranks read one batch
    dp_size: int
    start_step: int              # 0, or the step of the checkpoint resumed from
    fault: Fault | None          # DPCOMPARE_INJECT_FAULT, tests only (common/train/faults.py)
    rescue: Rescue | None        # ddp with --max-restarts: the last completed step kept (common/train/rescue.py)
    launch_time: float
    step_times: list[float] = field(default_factory=list)
    data_times: list[float] = field(default_factory=list)
    first_step_end: float | None = None
    # Start-up and training alone: the peak RSS before the first checkpoint gathers the state to save it.
    peak_rss_before_save_bytes: int | None = None

    def step_inputs(self, step: int):
        """(this rank's micro-batches, lr, global real-token count) of an optimizer step."""
        indices = self.sampler.global_batch_indices(step)
        mine = self.sampler.rank_part(indices, self.dp_rank, self.dp_size,  # its slice, or mlx-lm's stride
                                      self.cfg.rank_batch_sizes)  # of --rank-shares' sizes (data/shares.py)
        batches = [self.train_view.batch(m) for m in micro_batches(mine, self.cfg.grad_accum)]
        return batches, lr_for(self.cfg, step), self.train_view.real_target_count(indices)


def train(run_dir: Path, world: World, trainer_cls: TrainerClass) -> None:
    """Set up, train cfg.steps steps (from a checkpoint with --resume), then the profile and trace steps."""
    run = setup_run(Path(run_dir), world, trainer_cls)
    try:
        run_steps(run)
    finally:
        run.metrics.close()
    finish_run(run, world.size)


def setup_run(run_dir: Path, world: World, trainer_cls: TrainerClass) -> Run:
    """Read the plan and the data, build the Trainer from the seed checkpoint (or the one resumed)."""
    plan = RunPlan.read(run_dir)
    cfg, spec, rank = plan.config, plan.spec, world.rank
    strategy_layout = cfg.layout
    dp_rank, dp_size = strategy_layout.data_parallel(rank)
    global _live_status
    status = _live_status = RankStatus(run_dir, rank)
    # The framework's fixed footprint: the interpreter, the framework and its distributed state, before any
    # model exists (the memory table of the report, common/costmodel/memory.py's predicted peak).
    status.update(force=True, fixed_rss_bytes=rss_bytes(), cores=pinned_cores())
    cache = TokenCache.open(plan.token_cache)
    train_view = SequenceView(cache.split("train"), cfg.seq_len, cfg.sequence, mask_prompt=cfg.mask_prompt,
                          mask_convention=cfg.mask_convention, padding_rule=cfg.padding_rule)
    sampler = sampler_for(cfg.data_order, train_view.num_samples, cfg.global_batch_size, cfg.seed,
                          train_view.sample_lengths)
    fingerprints = resume_fingerprints(cfg, cache.meta, str(plan.token_cache))
    if frozen_base(cfg, spec):  # a checkpoint of adapters resumes only over the base they were trained on
        fingerprints["base_checksum"] = probe_checksum(seed_source(plan))
    trainer, start_step = start_trainer(plan, run_dir, world, trainer_cls, fingerprints, status)

    valid_view = None
    if "valid" in cache.meta.get("splits", {}) and cache.meta["splits"]["valid"]["num_documents"] > 0:
        valid_view = SequenceView(cache.split("valid"), cfg.seq_len, cfg.sequence, mask_prompt=cfg.mask_prompt,
                          mask_convention=cfg.mask_convention, padding_rule=cfg.padding_rule)

    metrics_path = run_dir / "metrics.jsonl"
    if rank == 0:
        truncate_metrics(metrics_path, start_step)
    metrics = MetricsWriter(metrics_path, enabled=rank == 0)
    if world.collectives is not None and cfg.link_probe:  # the link this job talks over, as its all-reduce sees it
        collectives = world.collectives()
        status.update(force=True, allreduce=probe_allreduce(collectives, cfg.resolved_backend))
        if strategy_layout.measures_all_gather and collectives.all_gather is not None:
            status.update(force=True, allgather=probe_allreduce(collectives, cfg.resolved_backend, op="all_gather"))
        if cfg.group_size and cfg.link_inner:  # two levels: the link inside each group too (docs/links.md)
            status.update(force=True, allreduce_inner=probe_group_allreduce(collectives, cfg.resolved_backend,
                                                                            cfg.group_size))
            if 1 < cfg.group_size < world.size:  # and the groups that cross machines at once, as outer axes do
                status.update(force=True, allreduce_across=probe_group_allreduce(
                    collectives, cfg.resolved_backend, cfg.group_size, across=True))
    global _rescue
    if cfg.max_restarts and world.size > 1 and strategy_layout.state_survives_a_lost_rank:
        _rescue = Rescue(run_dir, rank, saver(run_dir, spec, {**fingerprints, "framework": trainer.framework},
                                              cfg.checkpoint_format, cfg.trained.state_shapes(spec)))
    status.update(force=True, status="running", device=str(trainer.device), start_step=start_step, step=start_step)
    return balanced(Run(run_dir, cfg, spec, trainer, status, metrics, train_view, valid_view, sampler,  # auto shares
                        fingerprints, dp_rank, dp_size, start_step, fault=injected_fault(trainer.framework),
                        rescue=_rescue, launch_time=float(os.environ.get("DPCOMPARE_LAUNCH_TIME", time.time()))))


def seed_source(plan: RunPlan) -> SafetensorsSource:
    return SafetensorsSource(Path(plan.seed_checkpoint) / "model.safetensors")


def frozen_base(cfg: RunConfig, spec: ModelSpec) -> bool:
    """Whether some parameters never train (LoRA's base): they come from the seed whatever the checkpoint."""
    return bool(cfg.trained.modules(spec))  # LoRA's adapted modules; none when every parameter trains


def start_trainer(plan: RunPlan, run_dir: Path, world: World, trainer_cls: TrainerClass, fingerprints: dict,
                  status: RankStatus) -> tuple[Trainer, int]:
    """(the Trainer, the step it starts after): the latest checkpoint's state with --resume, else the seed's.

    The weights (and moments) are sources read slice by slice (common/checkpoint/tensorsource.py): each rank reads
    only what its strategy keeps, and its status records how many bytes that was (`weights_bytes_read`). What trains
    (common/model/lora.py) comes from the checkpoint, or starts at its initial values (the seed's, or LoRA's
    adapters drawn from the run's seed, written beside it: RunPlan.initial_adapters); a frozen base always comes from the seed (or --init-from) file."""
    cfg, spec = plan.config, plan.spec
    trained, start_step, resume_from = cfg.trained, 0, None
    if cfg.resume and (resume_from := latest_checkpoint(run_dir)) is not None:
        state = open_checkpoint(resume_from, spec, fingerprints, trained.state_shapes(spec))
        weights, start_step = state.weights, state.step
    else:
        # LoRA's initial adapters from their file beside the seed (a host without the launcher's cache draws the
        # same values itself)
        weights = (SafetensorsSource(plan.initial_adapters) if plan.initial_adapters and plan.initial_adapters.is_file()
                   else DictSource(trained.initial_values(spec, cfg.seed)))
    if frozen_base(cfg, spec):
        base = seed_source(plan)  # float32, or quantized (common/model/quantize.py): its tensors as stored
        check_source(spec, base, str(base.path), expected=cfg.base_storage.base_shapes(spec))
        weights = UnionSource(weights, base)
    elif resume_from is None:
        weights = seed_source(plan)
        check_source(spec, weights, str(weights.path))
    trainer = trainer_cls(cfg, spec, weights, world)
    read = {"weights_bytes_read": weights.bytes_read}
    if resume_from is not None:
        trainer.import_optimizer(state.exp_avg, state.exp_avg_sq, state.step)
        read["moments_bytes_read"] = state.exp_avg.bytes_read + state.exp_avg_sq.bytes_read
    status.update(force=True, **read)
    check_identical_weights(trainer, weights)
    return trainer, start_step


def run_steps(run: Run) -> None:
    """The training steps: one optimizer step each, its metrics, then eval and checkpoint when due."""
    cfg, trainer, rank = run.cfg, run.trainer, run.trainer.rank
    recompute_lost_eval(run)
    for step in range(run.start_step, cfg.steps):
        t_data = time.perf_counter()
        batches, lr, global_tokens = run.step_inputs(step)
        run.data_times.append(time.perf_counter() - t_data)

        if run.fault is not None and run.fault.during == "step" and \
                run.fault.due(rank, trainer.world_size, step + 1, run.start_step, run.run_dir):
            run.fault.strike(step + 1, run.status, run.run_dir)
        t0 = time.perf_counter()
        loss, grad_norm = trainer.train_step(batches, lr, global_tokens)
        step_time = time.perf_counter() - t0
        run.step_times.append(step_time)
        if run.first_step_end is None:  # a restart's figures read it (compare/launch/restarts.py)
            run.first_step_end = time.time()
            run.status.update(force=True, first_step_end=run.first_step_end)

        if not math.isfinite(loss):
            raise TrainingError(f"loss is {loss} at step {step + 1}; stopping (the last checkpoint "
                                f"is kept)")
        row = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": global_tokens,
               "step_time_s": step_time, "tokens_per_s": global_tokens / step_time,
               "epoch": run.sampler.epoch_of(step), "strategy": cfg.strategy}
        run.metrics.write(row)
        if run.rescue is not None:
            run.rescue.keep(step + 1, copy_state(trainer.export_state(), copy=not trainer.state_is_immutable), row)
        run.status.update(step=step + 1, loss=loss)
        after_step(run, step + 1)


def eval_due(cfg: RunConfig, done: int) -> bool:
    return bool(cfg.eval_every) and (done % cfg.eval_every == 0 or done == cfg.steps)


def recompute_lost_eval(run: Run) -> None:
    """A run resumed from step K whose eval of step K was lost (a rank died during it, after a survivor kept the
    step: common/train/rescue.py) computes it before its first step. Rank 0 holds the metrics (node 0 of several),
    so it decides, and every rank takes part in the eval."""
    done = run.start_step
    if not done or run.valid_view is None or not eval_due(run.cfg, done):
        return
    lost = 0.0
    if run.trainer.rank == 0:
        metrics = run.run_dir / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line] if metrics.exists() else []
        lost = float(not any(r.get("step") == done and "eval_loss" in r for r in rows))
    if run.trainer.all_sum(np.array([lost]), over="world")[0] > 0:
        run.metrics.write({"step": done, "eval_loss": evaluate(run.trainer, run.valid_view, run.cfg, run.dp_rank,
                                                                run.dp_size)})


def after_step(run: Run, done: int) -> None:
    """Eval every cfg.eval_every steps and at the end; a checkpoint every cfg.checkpoint_every and at the end."""
    cfg = run.cfg
    if run.fault is not None and run.fault.during == "eval" and eval_due(cfg, done) and \
            run.fault.due(run.trainer.rank, run.trainer.world_size, done, run.start_step, run.run_dir):
        run.fault.strike(done, run.status, run.run_dir)
    if run.valid_view is not None and eval_due(cfg, done):
        run.metrics.write({"step": done, "eval_loss": evaluate(run.trainer, run.valid_view, cfg, run.dp_rank,
                                                               run.dp_size)})
    if done == cfg.steps or (cfg.checkpoint_every and done % cfg.checkpoint_every == 0):
        if run.peak_rss_before_save_bytes is None:
            run.peak_rss_before_save_bytes = peak_rss_bytes()
        try:
            CHECKPOINT_WRITERS[cfg.checkpoint_format](run.trainer, run.run_dir, run.spec, done, run.fingerprints,
                                                      run.trainer.rank, cfg.trained.state_shapes(run.spec))
        except OSError as err:  # a full disk: name what was being written (the launcher prints one line)
            raise OSError(err.errno, err.strerror, err.filename or str(run.run_dir / "checkpoints")) from None


def finish_run(run: Run, world_size: int) -> None:
    """After the last step: every rank at the same step, the profile and trace steps, the final status."""
    cfg, trainer, status, step_times = run.cfg, run.trainer, run.status, run.step_times
    check_same_step(trainer, run.start_step + len(step_times))

    timed = step_times[cfg.timing_warmup_steps:] or step_times
    median = float(np.median(timed)) if timed else 0.0
    if cfg.profile_steps and timed:
        breakdown = profile(trainer, lambda k: run.step_inputs(cfg.steps + k), cfg.profile_steps, median,
                            float(np.median(run.data_times)), world_size,
                            progress=lambda k: status.update(force=True, status="profiling", profile_step=k))
        status.update(force=True, breakdown=breakdown)
    # Peaks before the op profile and --trace, whose buffers are no part of the run.
    status.update(peak_mem_bytes=trainer.peak_memory_bytes(), peak_rss_bytes=peak_rss_bytes())
    if cfg.op_profile and world_size == 1 and step_times:  # the op classes at the run's shapes
        try:
            record = op_profile(trainer, run.step_inputs(cfg.steps), run.spec, cfg.micro_batch_size, cfg.seq_len,
                                cfg.grad_accum, cfg.dtype,
                                progress=lambda k: status.update(force=True, status="profiling", op_profile_rep=k),
                                trained=cfg.trained)
        except Exception as err:  # noqa: BLE001 - the run is done: a profile that cannot run says why, and no more
            record = {"error": f"{type(err).__name__}: {err}"}
        status.update(force=True, op_profile=record)
    if cfg.trace and step_times:  # after the profile steps, so that they too run without a profiler
        files = trace(trainer, trainer.tracer, lambda k: run.step_inputs(cfg.steps + k), run.run_dir, trainer.rank,
                      world_size, progress=lambda k: status.update(force=True, status="tracing", trace_step=k))
        status.update(force=True, trace=files)
    status.update(force=True, status="ok", **final_figures(run, median, world_size))


def final_figures(run: Run, median: float, world_size: int) -> dict:
    """What the rank's status file reports once training is over (summary.json and the report read it)."""
    cfg, trainer, step_times = run.cfg, run.trainer, run.step_times
    return dict(
        state_bytes=trainer.state_bytes(), reduce_scatter=trainer.strategy.reduce_scatter,
        # What the first steps cost beyond a steady-state step: compilation, graph capture, warm caches.
        compile_s=max(0.0, sum(step_times[:cfg.timing_warmup_steps]) - median * min(len(step_times), cfg.timing_warmup_steps)),
        time_to_first_step_s=(run.first_step_end - run.launch_time) if run.first_step_end else None,
        steps_run=len(step_times), peak_rss_before_save_bytes=run.peak_rss_before_save_bytes,
        comm_bytes_per_step=trainer.comm_bytes_per_step() if step_times else None,
        comm_bytes_per_step_estimate=cfg.trained.comm_bytes_per_step_estimate(
            cfg.layout, run.spec, cfg.micro_batch_size, cfg.seq_len, cfg.grad_accum, cfg.dtype),
        **trainer.strategy.figures(),  # pp: the bubble, measured and analytic
    )


def evaluate(trainer, view: SequenceView, cfg: RunConfig, rank: int, world_size: int) -> float:
    """Global token-mean loss over a fixed set of validation samples, the same for every world size.

    rank and world_size are data-parallel ones (common/parallel/layout.py); `trainer.all_sum` sums over them."""
    per_rank = max(1, cfg.global_batch_size // world_size)
    count = min(cfg.eval_batches * cfg.global_batch_size, view.num_samples)
    indices = np.arange(count, dtype=np.int64)
    # Every sample, split as evenly as the ranks allow (a split of fewer samples than ranks used to be cut to none,
    # and its eval loss was NaN at N=2 while N=1 had one), each rank running the same number of batches: a rank
    # short of samples runs a masked one, so that fsdp's gathers and a pipeline's sends stay in step.
    parts = np.array_split(indices, world_size)
    mine, batches = parts[rank], max(math.ceil(len(part) / per_rank) for part in parts)
    loss_sum = 0.0
    for start in range(0, batches * per_rank, per_rank):
        if len(mine[start:start + per_rank]):
            loss_sum += trainer.eval_loss_sum(*view.batch(mine[start:start + per_rank]))
        elif count:
            inputs, targets, mask = view.batch(indices[:1])
            loss_sum += trainer.eval_loss_sum(inputs, targets, np.zeros_like(mask))
    tokens = view.real_target_count(indices) if count else 0
    # over the data-parallel ranks, or (pp) every stage: the last holds the losses, the others add 0
    total = trainer.all_sum(np.array([loss_sum], dtype=np.float64), over=trainer.strategy.loss_over)[0]
    return float(total / tokens) if tokens else float("nan")
