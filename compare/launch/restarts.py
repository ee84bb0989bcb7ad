"""--max-restarts and --min-nproc: what happens between two starts of a job (compare/launch/runner.py).

After a failure the watchdog stops every rank as always. Then, while restarts are left and the failure
is one a restart can cure, the job starts again from its latest checkpoint:
- ddp (a Layout whose state survives a lost rank): a survivor first saves the last completed step
  (common/train/rescue.py), so no step is recomputed; fsdp, tp and pp resume from the last periodic
  checkpoint and lose the steps since;
- a restart that fails again before it gets past the step where the previous start failed could not get
  its ranks back: with --min-nproc the next
  start runs at the largest world size from M to N-1 that keeps the global batch (more accumulation
  micro-steps at the same micro-batch where they divide it) and that the strategy can split the model
  over; every rank reads the checkpoint resharded for its new place (both checkpoint formats);
- not retried: a full disk (it fills again) and a non-finite loss (it is computed again, identically);
- an MLX hostfile job first asks each host of its hostfile whether it answers (ssh, as `doctor --fabric`
  does): with --min-nproc it goes on with the hosts that answer, from a hostfile of them written into the
  run directory (the user's file is left as it is); without, it waits for them up to DPCOMPARE_HOST_WAIT_S
  seconds (HOST_WAIT_S), says so in one line, and ends in one line if they never answer.
metrics.jsonl stays one curve: the resumed rank truncates it to the checkpoint's step (loop.py) and the
survivor's last row is appended where the rank that wrote metrics died before writing it.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from common.config import RunConfig
from common.errors import UserError
from common.metrics import read_json, read_metrics
from common.parallel import Mesh, layout, mesh_fields
from common.train import rescue

from .hosts import HOST_WAIT_ENV, host_wait_s, read_mlx_hostfile, unanswered
from .watchdog import failure_cause

NOT_RETRIED = {"disk full": "a full disk is not retried (free space, then --resume)",
               "not finite": "a non-finite loss or weights, or drifted replicas, come back at every restart "
                             "(lower --lr, then --resume)",
               "out of memory": "a rank killed for memory is killed again at every restart (a layout that fits: "
                                "`dpcompare plan --model`, then --resume)"}
FULL_BYTES = 64 * 1024    # less free than this where the run writes: a disk full, whatever the ranks said
RESCUE_TIMEOUT_S = 120.0  # a survivor saving the whole state: seconds at most, minutes for a large model
HOST_PROBE_S = 5.0       # ssh's connect timeout when asking a host whether it answers
HOST_POLL_S = 2.0        # between two asks while waiting
RESTART_HOSTFILE = "restart_hosts.json"  # the answering hosts a shrunk hostfile job goes on with


def disk_full(run_dir: Path) -> bool:
    """Under FULL_BYTES free where the run writes: what a rank that died unable to record its error left."""
    try:
        stat = os.statvfs(run_dir)
    except OSError:
        return False
    return stat.f_bavail * stat.f_frsize < FULL_BYTES


def cause_of(failure: dict, statuses: dict | None = None, run_dir: Path | None = None) -> str:
    """The failure's kind. A full disk is what any rank says it is: the rank blamed may be one that only
    lost its peer, or one that died unable to record its own error."""
    errors = [failure.get("error", "")] + [s.get("error") or "" for s in (statuses or {}).values()]
    if any(failure_cause(e) == "disk full" for e in errors) or (run_dir is not None and disk_full(run_dir)):
        return "disk full"
    cause = failure.get("cause", "failed")
    if cause == "failed" and "TrainingError" in failure.get("error", ""):  # common/train/rank_checks.py
        return "not finite"
    return cause


def at_world_size(cfg: RunConfig, nproc: int, grad_accum: int) -> RunConfig:
    """cfg at `nproc` ranks: a one-axis strategy spans them all; a mesh keeps its model axes and grows or shrinks
    its data axis (`Mesh.resized`), or is refused with a UserError where it cannot."""
    if not cfg.mesh:
        return cfg.replace(nproc=nproc, grad_accum=grad_accum)
    grid = Mesh.parse(cfg.mesh).resized(nproc * cfg.nnodes)
    if grid is None:
        raise UserError(f"the model axes of --mesh {cfg.mesh} do not divide {nproc * cfg.nnodes} ranks")
    fields = mesh_fields({"mesh": grid.text, "strategy": None})
    return cfg.replace(nproc=nproc, grad_accum=grad_accum, mesh=fields["mesh"], strategy=fields["strategy"])


def next_world(cfg: RunConfig, min_nproc: int, largest: int | None = None) -> tuple[RunConfig | None, list[str]]:
    """The largest world size from `min_nproc` to cfg.nproc - 1 (or `largest`, where smaller: the hosts that
    answer) that keeps the global batch: (its config or
    None, why each larger size was passed over). Accumulation fills in at the same micro-batch where it
    divides; else the smallest accumulation that splits the batch at no larger a micro-batch. A mesh keeps
    its model axes (tp, pp) and shrinks its data axis."""
    micro, refused = cfg.micro_batch_size, []
    top = cfg.nproc - 1 if largest is None else min(largest, cfg.nproc - 1)
    for nproc in range(top, max(min_nproc, 1) - 1, -1):
        try:
            dp = at_world_size(cfg, nproc, 1).data_parallel_size if cfg.mesh else layout(cfg.strategy, nproc).dp_size
        except UserError as err:
            if nproc > 1:
                refused.append(f"{nproc} ranks: {err}")
                continue
            dp = 1  # one rank holds the whole model whatever the layout: ddp below
        accums = [a for a in range(1, cfg.global_batch_size // dp + 1)
                  if cfg.global_batch_size % (dp * a) == 0 and cfg.global_batch_size // (dp * a) <= micro]
        if not accums:
            refused.append(f"{nproc} ranks: global batch {cfg.global_batch_size} does not split into micro-batches "
                           f"of at most {micro}")
            continue
        try:
            return at_world_size(cfg, nproc, accums[0]), refused
        except UserError as err:
            refused.append(f"{nproc} ranks: {err}")
        if nproc == 1 and cfg.strategy != "ddp":  # one rank holds the whole model whatever the strategy
            refused[-1] += "; ddp instead, as one rank holds the whole model"
            return cfg.replace(nproc=1, grad_accum=accums[0], strategy="ddp", mesh=""), refused
    return None, refused


@dataclass
class Restarts:
    """The restarts of one run: decided here, recorded in summary.json's `restarts`."""
    cfg: RunConfig
    records: list[dict] = field(default_factory=list)

    @property
    def attempt(self) -> int:
        return len(self.records)

    def can_rescue(self, cfg: RunConfig, failure: dict, statuses: dict, run_dir: Path) -> bool:
        """Whether a survivor should save its last completed step before the job is stopped."""
        return (self.attempt < self.cfg.max_restarts and cfg.world_size > 1
                and cause_of(failure, statuses, run_dir) not in NOT_RETRIED
                and cfg.layout.state_survives_a_lost_rank)

    def after_failure(self, cfg: RunConfig, failure: dict, run_dir: Path, detected_at: float,
                      statuses: dict, rescued: dict | None) -> RunConfig | None:
        """The config of the next start, recorded; None where there is none (the failure then says why)."""
        cause = cause_of(failure, statuses, run_dir)
        if cause == "disk full":
            failure["cause"] = cause
        if self.attempt >= self.cfg.max_restarts:
            if self.cfg.max_restarts:
                failure["error"] += f" [restarts exhausted: {self.cfg.max_restarts}]"
            return None
        if cause in NOT_RETRIED:
            failure["error"] += f" [not restarted: {NOT_RETRIED[cause]}]"
            return None
        try:
            completed = merge_rescued_row(run_dir / "metrics.jsonl", rescued)
        except OSError as err:
            failure["error"] += f" [not restarted: cannot write {err.filename or run_dir}: {err.strerror}]"
            return None
        resumed_from = checkpoint_step(run_dir)
        nxt, note, skipped = cfg.replace(resume=True), "", []
        if hostfile_job(cfg):
            answering, skipped = self.hosts_that_answer(cfg, failure, run_dir)
            if answering is None:
                return None
            nxt = answering
            note = f"hosts that do not answer: {', '.join(skipped)}" if skipped else ""
        if not skipped and self.cannot_get_ranks_back(completed) and self.cfg.min_nproc and self.cfg.min_nproc < cfg.nproc:
            smaller, refused = next_world(cfg, self.cfg.min_nproc)
            if smaller is None:
                failure["error"] += (f" [not restarted: no world size from {self.cfg.min_nproc} to {cfg.nproc - 1} "
                                     f"works: {'; '.join(refused)}]")
                return None
            nxt, note = smaller.replace(resume=True), "; ".join(refused)
        fault_at = min((s["fault_at"] for s in statuses.values() if s.get("fault_at")), default=None)
        self.records.append({
            "attempt": self.attempt + 1, "step": completed + 1, "cause": cause, "rank": failure.get("failed_rank"),
            "error": failure.get("error"), "resumed_from": resumed_from, "steps_lost": completed - resumed_from,
            "how": ("survivor_checkpoint" if rescued and rescued.get("step") == resumed_from and resumed_from
                    else "last_checkpoint"),
            "rescue_error": (rescued or {}).get("error"),
            "nproc_before": cfg.nproc, "nproc_after": nxt.nproc, "grad_accum_after": nxt.grad_accum,
            "strategy_after": nxt.strategy, "mesh_after": nxt.mesh or None,
            "passed_over": note or None, "hosts_skipped": skipped or None,
            "hostfile_after": (nxt.hostfile or None) if skipped else None,
            "failed_at": fault_at or detected_at, "detect_s": (detected_at - fault_at) if fault_at else None,
            "seconds": None})
        return nxt

    def hosts_that_answer(self, cfg: RunConfig, failure: dict, run_dir: Path) -> tuple[RunConfig | None, list[str]]:
        """The next start of a hostfile job, once its hosts were asked whether they answer: (its config, the
        hosts skipped), or (None, []) with the failure saying why there is none."""
        hosts = read_mlx_hostfile(cfg.hostfile).hosts
        down = unanswered(hosts, HOST_PROBE_S)
        if not down:
            return cfg.replace(resume=True), []
        named = "; ".join(f"{host} ({why})" for host, why in down.items())
        if self.cfg.min_nproc and self.cfg.min_nproc < cfg.nproc:
            up = [h for h in hosts if h["ssh"] not in down]
            smaller, refused = next_world(cfg, self.cfg.min_nproc, largest=len(up)) if up else (None, [])
            if smaller is None:
                failure["error"] += (f" [not restarted: {len(up)} of {len(hosts)} hosts answer, --min-nproc "
                                     f"{self.cfg.min_nproc}; not answering: {named}"
                                     + (f"; {'; '.join(refused)}" if refused else "") + "]")
                return None, []
            try:
                return shrunk_onto(smaller, up[:smaller.nproc], cfg.hostfile, run_dir), list(down)
            except OSError as err:
                failure["error"] += f" [not restarted: cannot write {err.filename or run_dir}: {err.strerror}]"
                return None, []
        wait_s = host_wait_s()
        say(run_dir, f"dpcompare: waiting up to {wait_s:g} s ({HOST_WAIT_ENV}) for host {named} of "
                     f"{cfg.hostfile} to answer before restarting (--min-nproc would go on without it)")
        deadline = time.time() + wait_s
        while down and time.time() < deadline:
            time.sleep(max(0.0, min(HOST_POLL_S, deadline - time.time())))
            down = unanswered(hosts, min(HOST_PROBE_S, max(1.0, deadline - time.time())))
        if down:
            failure["error"] += (f" [not restarted: host {', '.join(down)} of {cfg.hostfile} did not answer "
                                 f"within {wait_s:g} s ({HOST_WAIT_ENV}); --min-nproc would go on without it]")
            return None, []
        return cfg.replace(resume=True), []

    def cannot_get_ranks_back(self, completed: int) -> bool:
        """A restart that failed again before it got past the step where the previous start failed: these
        ranks are not to be had (a rank that dies at every start, a host that is down)."""
        return bool(self.records) and completed + 1 <= self.records[-1]["step"]

    def started(self, first_step_end: float | None) -> None:
        """The attempt after the latest restart completed its first step at `first_step_end` (epoch s)."""
        if self.records and first_step_end and self.records[-1]["seconds"] is None:
            self.records[-1]["seconds"] = first_step_end - self.records[-1]["failed_at"]


def hostfile_job(cfg: RunConfig) -> bool:
    """A job that one mlx.launch starts over the hosts of an MLX JSON hostfile (not MPI's text hostfile)."""
    if not (cfg.hostfile and cfg.framework == "mlx" and cfg.nnodes == 1 and cfg.resolved_backend != "mpi"):
        return False
    try:
        read_mlx_hostfile(cfg.hostfile)
    except ValueError:
        return False
    return True


def shrunk_onto(smaller: RunConfig, hosts: list[dict], hostfile: str, run_dir: Path) -> RunConfig:
    """`smaller` over `hosts`: a hostfile of them in the run directory, in the user's file's form (its backend
    and envs kept); one local host (127.0.0.1) runs as one plain process, as a one-rank job does."""
    if len(hosts) == 1 and hosts[0]["ssh"] == "127.0.0.1":
        return smaller.replace(hostfile="", resume=True)
    original = read_mlx_hostfile(hostfile)
    kept = [original.hosts.index(h) for h in hosts]
    # jaccl's "rdma" lists one device per host of the file: only the kept hosts' columns stay
    hosts = [{**h, "rdma": [h["rdma"][j] for j in kept]} if len(h["rdma"]) == len(original.hosts) else h
             for h in hosts]
    data: object = hosts
    if original.backend or original.envs:
        data = {"backend": original.backend, "envs": original.envs, "hosts": hosts}
    path = run_dir / RESTART_HOSTFILE
    path.write_text(json.dumps(data, indent=1) + "\n")
    return smaller.replace(hostfile=str(path), resume=True)


def say(run_dir: Path, line: str) -> None:
    """One line from dpcompare itself, on stderr and in log.txt."""
    import sys

    print(line, file=sys.stderr, flush=True)
    try:
        with open(run_dir / "log.txt", "a") as log:
            log.write(line + "\n")
    except OSError:
        pass


def checkpoint_step(run_dir: Path) -> int:
    """The step of the latest checkpoint (0: none; the restart starts from the seed weights)."""
    from common.checkpoint.store import latest_checkpoint

    latest = latest_checkpoint(run_dir)
    return int((read_json(latest / "state.json") or {}).get("step", 0)) if latest else 0


def merge_rescued_row(metrics: Path, rescued: dict | None) -> int:
    """The last completed step in metrics.jsonl, after appending the survivor's row of its saved step where
    the rank that writes metrics died before writing it."""
    train, _ = read_metrics(metrics)
    last = train[-1]["step"] if train else 0
    row = (rescued or {}).get("row")
    if row and row["step"] == last + 1:
        with open(metrics, "a") as f:
            f.write(json.dumps(row) + "\n")
        last = row["step"]
    return last


def wait_for_rescue(run_dir: Path, alive, timeout_s: float = RESCUE_TIMEOUT_S) -> dict | None:
    """The saving rank's answer, or None when it died or took longer than `timeout_s`."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if (done := rescue.answer(run_dir)) is not None:
            return done
        if not alive():
            return rescue.answer(run_dir)
        time.sleep(0.05)
    return None
