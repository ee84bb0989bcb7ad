"""Start one run (a framework at a world size) as subprocesses, watch its ranks, write summary.json.

The inputs every run of a comparison shares (token cache, model spec, seed checkpoint) are prepared
here once; `launchers` builds the command lines, `watchdog` ends the job when a rank fails or hangs.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from common.train import rescue, supervisor
from common.train.faults import ATTEMPT_ENV
from common.config import RunConfig
from common.errors import UserError
from common.metrics import write_json
from common.parallel import describe_mesh
from common.runplan import PLAN_FILE, RunPlan
from common.model.spec import ModelSpec

from ..machine import environment as env
from ..machine.kernels import cold_start_line
from ..machine.backends import check_available
from ..report import tracking
from ..report.samples import SAMPLE_FILE
from .hosts import RING_HOSTFILE, check_hostfile, ring_hosts, with_hostfile_backend
from .launchers import build_command
from .netns import EmulatedLink, check_can_emulate, loopback_record
from ..report.restarts import restart_line
from .restarts import Restarts, wait_for_rescue
from .summary import summarize
from .watchdog import process_state, read_ranks, stop_job, watch, watched_ranks

PROJECT_ROOT = Path(__file__).resolve().parents[2]
RUN_FILES = (PLAN_FILE, "metrics.jsonl", "summary.json", "log.txt", "ranks", "checkpoints", RING_HOSTFILE, "tensorboard",
             "wandb", "trace", SAMPLE_FILE, "restart_hosts.json")  # the last: launch/restarts.py


@dataclass
class Inputs:
    """What every run of a comparison shares: one token cache, one model spec, one seed checkpoint."""
    token_cache: Path
    spec: ModelSpec
    seed_checkpoint: Path
    cache_meta: dict

    def plan(self, cfg: RunConfig) -> RunPlan:
        """The run plan of one run of the comparison (common/runplan.py): what its ranks read."""
        return RunPlan.of(cfg, self.spec, self.token_cache, self.seed_checkpoint, self.cache_meta)


def prepare_inputs(cfg: RunConfig) -> Inputs:
    from common.data.sampler import sampler_for
    from common.data.sequences import SequenceView
    from common.data.tokencache import prepare_tokens

    cache = prepare_tokens(cfg.dataset, cfg.resolved_tokenizer, cache_dir=cfg.cache_path, split=cfg.dataset_split,
                           text_field=cfg.text_field, streaming=cfg.streaming, val_fraction=cfg.val_fraction,
                           builtin_vocab_size=cfg.builtin_vocab_size, builtin_bytes=cfg.builtin_corpus_bytes,
                           progress=not cfg.quiet)
    spec = cfg.model_spec(vocab_size=int(cache.meta["vocab_size"]))
    view = SequenceView(cache.split("train"), cfg.seq_len, cfg.sequence, mask_prompt=cfg.mask_prompt,
                        mask_convention=cfg.mask_convention, padding_rule=cfg.padding_rule)
    sampler_for(cfg.data_order, view.num_samples, cfg.global_batch_size, cfg.seed,  # fails early when data is too
                view.sample_lengths)                                                 # small
    seed_dir = Path(cfg.init_from) if cfg.init_from else seed_checkpoint(spec, cfg.seed, cfg.cache_path)
    seed_dir = base_folder(seed_dir, spec, cfg)
    return Inputs(token_cache=Path(cache.path), spec=spec, seed_checkpoint=seed_dir, cache_meta=cache.meta)


def base_folder(seed_dir: Path, spec: ModelSpec, cfg: RunConfig) -> Path:
    """The folder every rank reads the base from, its tensors checked against the spec from their headers: the
    seed or --init-from folder, or (--quantize-base) that folder quantized once into the cache."""
    from common.checkpoint.tensorsource import SafetensorsSource, check_source
    from common.model.quantize import folder_quantization, quantized_seed
    from common.model.weights import load_pretrained

    storage = cfg.base_storage
    if folder_quantization(seed_dir) is None:
        if cfg.init_from:  # the spec is the folder's (RunConfig.model_spec); its tensors must fit it
            load_pretrained(seed_dir)
        if not storage.modules(spec):
            return seed_dir
        seed_dir = quantized_seed(seed_dir, spec, storage, cfg.cache_path)
    weights = seed_dir / "model.safetensors"
    if not weights.is_file():
        raise UserError(f"{weights} not found: expected a quantized Llama folder (mlx_lm.convert -q writes one)")
    check_source(spec, SafetensorsSource(weights), str(weights), expected=storage.base_shapes(spec))
    return seed_dir


def seed_checkpoint(spec: ModelSpec, seed: int, cache_dir: Path) -> Path:
    """The seeded numpy init, written once per (spec, seed) and shared by every run and framework."""
    from common.model.weights import init_weights, save_pretrained

    key = hashlib.sha256(json.dumps([spec.to_dict(), seed], sort_keys=True).encode()).hexdigest()[:16]
    final = Path(cache_dir) / "seeds" / key
    if (final / "model.safetensors").exists() and (final / "config.json").exists():
        return final
    tmp = final.with_name(f".{key}.tmp{os.getpid()}")
    save_pretrained(tmp, spec, init_weights(spec, seed))
    try:
        os.replace(tmp, final)
    except OSError:  # another process won the race; its copy is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def check_run_dir(run_dir: Path, resume: bool, overwrite: bool, clear: bool = False) -> None:
    """Never silently overwrite a run: refuse, resume it, or (--overwrite) remove only dpcompare's files
    (and only when `clear`, i.e. once every other check has passed)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"output path {run_dir} exists and is not a directory")
    holds_run = run_dir.is_dir() and any((run_dir / name).exists() for name in RUN_FILES)
    if holds_run and not (resume or overwrite):
        raise UserError(f"{run_dir} already holds a run; pass --resume to continue it, --overwrite to "
                        "replace it, or choose another --out")
    if holds_run and overwrite and not resume and clear:
        for name in RUN_FILES:
            target = run_dir / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
    parent = run_dir if run_dir.exists() else next(p for p in run_dir.parents if p.exists())
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise UserError(f"cannot write to output directory {run_dir}: {parent} is not a writable directory")


def check_resumable(cfg: RunConfig, inputs: Inputs, run_dir: Path) -> None:
    """Validate the checkpoint a --resume would load before anything is started or written."""
    from common.checkpoint.store import latest_checkpoint, load_checkpoint, resume_fingerprints

    latest = latest_checkpoint(run_dir) if cfg.resume else None
    if latest is not None:
        load_checkpoint(latest, inputs.spec, resume_fingerprints(cfg, inputs.cache_meta, str(inputs.token_cache)),
                        cfg.trained.state_shapes(inputs.spec))


def launch(cfg: RunConfig, inputs: Inputs, run_dir: Path) -> dict:
    """Run every rank to the end (or to the first failure, restarting it up to --max-restarts times) and
    return the summary written to disk."""
    run_dir = Path(run_dir).absolute()  # the ranks run in the project's directory (cwd below), not the caller's
    check_run_dir(run_dir, cfg.resume, cfg.overwrite)
    check_hostfile(cfg)
    cfg = with_hostfile_backend(cfg)  # an MLX hostfile's "backend" applies unless --backend says otherwise
    check_available(cfg)
    check_resumable(cfg, inputs, run_dir)
    tracking.check_installed(cfg.report_to)
    if cfg.link and cfg.world_size > 1:
        check_can_emulate(cfg.link)
    if not cfg.quiet and (cold := cold_start_line(cfg)):  # before the kernel timings and the progress bar
        print(f"dpcompare: note: {cold}", file=sys.stderr, flush=True)
    build_command(cfg, run_dir, spec=inputs.spec)  # refuses a job it cannot start before anything is written
    check_run_dir(run_dir, cfg.resume, cfg.overwrite, clear=True)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"cannot write to output directory {run_dir}: {err.strerror}") from None
    started = time.time()
    restarts, job = Restarts(cfg), cfg
    while True:
        attempt = run_attempt(job, inputs, run_dir, restarts)
        if attempt.failure is None or attempt.interrupted is not None:
            break
        nxt = restarts.after_failure(job, attempt.failure, run_dir, attempt.detected_at, attempt.statuses,
                                     attempt.rescued)
        if nxt is None:
            break
        with open(run_dir / "log.txt", "a") as log:
            log_line(log, f"restarting: {restart_line(restarts.records[-1], cfg.max_restarts)}")
        job = nxt
    summary = summarize(job, run_dir, attempt.argv, attempt.blas, time.time() - started, attempt.failure,
                        attempt.link_record)
    if cfg.max_restarts:
        summary.update(restarts=restarts.records, max_restarts=cfg.max_restarts, nproc_requested=cfg.nproc)
    write_summary(run_dir, summary)
    if attempt.interrupted is not None:
        attempt.interrupted.detail = summary["error"]
        raise attempt.interrupted
    if cfg.node_rank == 0:  # node 0 holds metrics.jsonl
        tracking.report_run_safely(run_dir, cfg.report_to)
    return summary


def log_line(log, text: str) -> None:
    """A line of log.txt from dpcompare itself; a full disk loses the line, not the run's cleanup."""
    try:
        log.write(text + "\n")
        log.flush()
    except OSError:
        pass


def write_summary(run_dir: Path, summary: dict) -> None:
    """summary.json, or one line naming it where the disk is full (the run's status is then the failure's)."""
    try:
        write_json(run_dir / "summary.json", summary)
    except OSError as err:
        detail = f"cannot write {run_dir / 'summary.json'}: {err.strerror}"
        summary.update(status="failed", error=f"{summary['error']}; {detail}" if summary.get("error") else detail)


@dataclass
class Attempt:
    """One start of the job: how it ended, and what the restart decision reads."""
    argv: list[str]
    blas: str
    failure: dict | None = None
    interrupted: KeyboardInterrupt | None = None
    link_record: dict | None = None
    detected_at: float = 0.0
    statuses: dict = field(default_factory=dict)   # each rank's last status file
    rescued: dict | None = None                    # the survivor's answer (common/train/rescue.py)


def run_attempt(cfg: RunConfig, inputs: Inputs, run_dir: Path, restarts: Restarts) -> Attempt:
    """Start every rank once (restart k of the run when restarts.attempt is k), watch them, stop them."""
    link = EmulatedLink(cfg.link, cfg.nproc, cfg.link_inner, cfg.group_size) if cfg.link and cfg.world_size > 1 \
        else None
    argv, extra_env, blas = build_command(cfg, run_dir, link=link, spec=inputs.spec)
    attempt = Attempt(argv, blas)
    try:
        inputs.plan(cfg).write(run_dir)
        if "MLX_HOSTFILE" in extra_env:
            write_json(Path(extra_env["MLX_HOSTFILE"]), ring_hosts(cfg))
    except OSError as err:  # a full disk before any rank started: one line, no restart
        attempt.failure = {"failed_rank": None, "cause": "disk full" if err.errno == errno.ENOSPC else "failed",
                           "error": f"cannot write {err.filename or run_dir}: {err.strerror}"}
        return attempt
    shutil.rmtree(run_dir / "ranks", ignore_errors=True)
    shutil.rmtree(run_dir / "trace", ignore_errors=True)  # a resumed run's old traces would be listed as its own
    started = time.time()
    child_env = env.child_env({**extra_env, "PYTHONUNBUFFERED": "1", "DPCOMPARE_LAUNCH_TIME": str(started),
                               ATTEMPT_ENV: str(restarts.attempt),
                               supervisor.ENV: supervisor.identity()})  # ranks exit by themselves if this process dies

    def rescue_first(failure: dict) -> None:  # ddp: a survivor saves the last completed step (rescue.py)
        attempt.detected_at = time.time()
        ranks = read_ranks(run_dir, watched_ranks(cfg))
        if not restarts.can_rescue(cfg, failure, ranks, run_dir):
            return
        here = os.uname().nodename  # a pid names a process of this host only
        alive = [r for r, info in sorted(ranks.items()) if info.get("host", here) == here
                 and process_state(info.get("pid")) not in (None, "Z", "T") and r != failure.get("failed_rank")]
        if alive:
            try:
                rescue.request(run_dir, alive[0])
            except OSError:  # no room for the request: no room for a checkpoint either
                return
            pid = ranks[alive[0]].get("pid")
            attempt.rescued = wait_for_rescue(run_dir, lambda: process_state(pid) not in (None, "Z"))

    with open(run_dir / "log.txt", "a") as log:
        shown = {k: v for k, v in extra_env.items() if k.startswith(("MLX_RANK", "MLX_HOSTFILE", "GLOO_"))}
        log_line(log, f"$ {shlex.join([f'{k}={v}' for k, v in shown.items()] + argv)}")
        if cfg.mesh:  # which ranks talk on which axis: where the fast links matter (docs/strategies.md)
            log_line(log, f"mesh {cfg.mesh}, the ranks of each group: " + "; ".join(describe_mesh(cfg.mesh)))
        if cfg.layout.mesh.has("pp"):  # how many pieces, and whether the user chose them
            rows = cfg.global_batch_size // (cfg.data_parallel_size * cfg.grad_accum)
            log_line(log, f"pipeline: {cfg.pp_pieces} pieces per micro-step of {rows} sequences, "
                          + ("--pp-microbatches" if cfg.pp_microbatches else "the default (the largest count up to 4 "
                             "that divides it, at least one per stage for torch)"))
        proc = None
        attempt.link_record = loopback_record() if cfg.world_size > 1 and cfg.nnodes == 1 and not cfg.hostfile \
            else None
        # The job is stopped inside the `with`, so an emulated link's namespaces go only after its ranks.
        with link or nullcontext():
            try:
                if link:
                    attempt.link_record = link.record(link.measure())
                    inner = attempt.link_record.get("inner")
                    log_line(log, f"link: {attempt.link_record['note']}; TCP measured "
                                  f"{(attempt.link_record['tcp_bandwidth_Bps'] or 0) * 8e-6:.0f} Mbit/s, "
                                  f"{(attempt.link_record['tcp_latency_s'] or 0) * 1e6:.0f} us one way, a 64 KB "
                                  f"message after idling {(attempt.link_record.get('tcp_message_Bps') or 0) * 8e-6:.0f}"
                                  " Mbit/s"
                                  + (f"; inside a group {(inner['tcp_bandwidth_Bps'] or 0) * 8e-6:.0f} Mbit/s"
                                     if inner else ""))
                # A session of its own: the whole job can be signalled at once, and nothing outlives it.
                proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env=child_env, cwd=PROJECT_ROOT, start_new_session=True)
                attempt.failure = watch(proc, run_dir, cfg, before_stop=rescue_first)
            except KeyboardInterrupt as stop:  # Interrupted, or a plain KeyboardInterrupt (SIGINT)
                attempt.interrupted = stop
                attempt.failure = stop_interrupted(proc, run_dir, cfg, getattr(stop, "signum", signal.SIGINT))
    attempt.statuses = read_ranks(run_dir, watched_ranks(cfg))
    restarts.started(attempt.statuses.get(0, {}).get("first_step_end"))
    return attempt


def stop_interrupted(proc: subprocess.Popen | None, run_dir: Path, cfg: RunConfig, signum: int) -> dict:
    """Stop the whole job because dpcompare was signalled; the summary's status becomes "interrupted"."""
    from common.checkpoint.store import latest_checkpoint

    name = signal.Signals(signum).name
    if proc is not None:  # else the signal came during Popen: the ranks see this process gone and exit
        stop_job(proc, run_dir, reason=f"dpcompare received {name}")
    ranks = read_ranks(run_dir, watched_ranks(cfg))
    step = max((r.get("step", 0) for r in ranks.values()), default=0)
    latest = latest_checkpoint(run_dir)
    kept = f"last checkpoint {latest.name} (continue with --resume)" if latest else "no checkpoint yet"
    return {"status": "interrupted", "signal": name, "failed_rank": None,
            "error": f"{cfg.framework} x{cfg.nproc * cfg.nnodes} interrupted by {name} after step {step}; {kept}"}
