"""Watching a run's ranks: `mlx.launch` exits 0 even when a rank dies, so exit codes are not trusted.

Every rank writes ranks/rank{r}.json (status, pid, heartbeat, step). The watchdog ends the whole job
when a rank fails, dies without a word, stops, or no rank makes progress for `collective_timeout_s`,
and names the rank to blame: a peer's timeout error points at the wrong one. With several nodes each
node watches only its own ranks.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

from common.config import RunConfig
from common.metrics import read_json, write_json
from common.train.supervisor import request_stop

from ..machine.oom import oom_killed
from .slurm import allocation_revoked, this_host_only

POLL_S = 0.2
KILL_GRACE_S = 3.0
STARTUP_GRACE_S = 120.0  # imports and data opening before a rank's first heartbeat


def watched_ranks(cfg: RunConfig) -> list[int]:
    """The ranks this process starts and watches: all of them, or this node's with --nnodes > 1."""
    if cfg.nnodes > 1:
        return list(range(cfg.node_rank * cfg.nproc, (cfg.node_rank + 1) * cfg.nproc))
    return list(range(cfg.nproc))


def watch(proc: subprocess.Popen, run_dir: Path, cfg: RunConfig,
          before_stop: Callable[[dict], None] | None = None) -> dict | None:
    """None when every rank finished ok; else {"error", "failed_rank", "cause"} after stopping the job.
    `before_stop(failure)` runs while the survivors still live (--max-restarts: one saves its last step).

    With --nnodes > 1 only this node's ranks are watched (they are local processes); the others are
    watched by their own node's dpcompare, and a peer that is gone shows here as a stall or a timeout."""
    expected = watched_ranks(cfg) if cfg.nnodes > 1 else list(range(cfg.nproc * cfg.nnodes))
    local = (cfg.nnodes > 1 or not cfg.hostfile) and this_host_only(cfg)  # else rank pids mean nothing here
    lead = expected[0]
    bar = progress_bar(cfg)
    last_progress, last_seen = time.time(), None
    while True:
        code = proc.poll()
        ranks = read_ranks(run_dir, expected)
        seen = tuple((r.get("step"), r.get("status"), r.get("profile_step"), r.get("trace_step"))
                     for r in ranks.values())
        if seen != last_seen:
            last_seen, last_progress = seen, time.time()
        if bar is not None and lead in ranks:
            bar.n = ranks[lead].get("step", 0)
            if "loss" in ranks[lead]:
                bar.set_postfix(loss=f"{ranks[lead]['loss']:.4f}", refresh=False)
            bar.refresh()
        failure = diagnose(ranks, expected, local, code)
        stalled = time.time() - last_progress
        # --rank-speed stops a rank on purpose (spawn.py's duty cycle): no sign of a stop in start-up
        limit = cfg.collective_timeout_s + (STARTUP_GRACE_S if starting(ranks, expected, local and not cfg.rank_speed)
                                            else 0)
        # One rank waits on no peer, so silence is a slow step (MLX bf16 `small` on a CPU: over a minute),
        # not a hang; a dead process is still caught by `diagnose`.
        stall = failure is None and code is None and stalled > limit and cfg.nproc * cfg.nnodes > 1
        if stall:
            culprit = slowest(ranks, expected)
            info = ranks.get(culprit, {})
            state = "is stopped (SIGSTOP?)" if process_state(info.get("pid")) == "T" else "looks hung"
            failure = {"failed_rank": culprit, "cause": "stopped" if "SIGSTOP" in state else "hung",
                       "error": f"rank {culprit} (pid {info.get('pid')}) {state} in step {info.get('step', 0) + 1}: "
                                f"no rank {'on this node ' if cfg.nnodes > 1 else ''}made progress for "
                                f"{stalled:.0f} s (collective timeout {cfg.collective_timeout_s:g} s)"}
            if culprit not in ranks:  # its status file appears once the framework has joined every rank
                failure["cause"] = "never started"
                failure["error"] = (f"rank {culprit} never started: no status from it after {stalled:.0f} s "
                                    "(a rank waits until every rank of the job has joined)")
        if failure is not None and cfg.nnodes > 1 and (stall or is_peer_error(failure["error"])):
            failure["error"] += (f" [node {cfg.node_rank} of {cfg.nnodes}: a rank on another node may have "
                                 "failed, or the network between the nodes is down; see their logs]")
        if failure is not None and allocation_revoked(cfg):  # scancel, a time limit: a stop, not a failure
            if bar is not None:
                bar.close()
            raise Interrupted(signal.SIGTERM)
        if failure is not None:
            if bar is not None:
                bar.close()
            failure.setdefault("cause", "failed")
            try:
                if before_stop is not None:
                    before_stop(failure)
            finally:  # whatever happened there, nothing of the job is left running
                stop_job(proc, run_dir)
            return failure
        if code is not None:
            if bar is not None:
                bar.close()
            return None
        try:  # returns as soon as the job exits, not up to POLL_S later: a fraction of a second of every run
            proc.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            pass


def starting(ranks: dict, expected: list[int], local: bool) -> bool:
    """Still in start-up: a rank has not joined, or none has finished its first step since it started (that
    step compiles: MLX's kernels took over a minute on 2 loaded cores), unless one is stopped (SIGSTOP)."""
    if len(ranks) < len(expected):
        return True
    first = all(r.get("step", 0) == r.get("start_step", 0) and r.get("status") != "ok" for r in ranks.values())
    return first and not (local and any(process_state(r.get("pid")) == "T" for r in ranks.values()))


def diagnose(ranks: dict, world, local: bool, exit_code: int | None) -> dict | None:
    """`world`: the number of ranks (0..world-1) or the list of rank ids this process watches."""
    expected = list(range(world)) if isinstance(world, int) else list(world)
    failed = [r for r in ranks.values() if r.get("status") == "failed"]
    for rank, info in sorted(ranks.items()):
        if info.get("status") in ("ok", "failed") or not local:
            continue
        state = process_state(info.get("pid"))
        if state is None or state == "Z":
            if rss := oom_killed(info.get("pid")):
                return {"failed_rank": rank, "cause": "out of memory", "error": f"rank {rank} (pid {info.get('pid')}) "
                        f"was killed by the kernel's out-of-memory killer in step {info.get('step', 0) + 1}, at "
                        f"{rss / 1e9:.1f} GB resident; `dpcompare plan --model` names a layout that fits"}
            return {"failed_rank": rank, "cause": "died", "error": f"rank {rank} (pid {info.get('pid')}) died in step "
                                                  f"{info.get('step', 0) + 1} without reporting an error "
                                                  "(killed by a signal or out of memory?)"}
    if failed:
        # A peer's timeout error points at the wrong rank; a real error message names the culprit.
        first = min(failed, key=lambda r: (is_peer_error(r.get("error", "")), r["rank"]))
        silent = [r for r in expected if ranks.get(r, {}).get("status") not in ("failed", "ok")]
        if is_peer_error(first.get("error", "")) and silent:
            culprit = silent[0]
            state = process_state(ranks.get(culprit, {}).get("pid")) if local else "?"
            what = "is stopped (SIGSTOP?)" if state == "T" else "stopped responding"
            return {"failed_rank": culprit, "cause": "stopped" if state == "T" else "hung",
                    "error": f"rank {culprit} {what} in step "
                                                     f"{ranks.get(culprit, {}).get('step', 0) + 1}; rank "
                                                     f"{first['rank']} reports: {first.get('error')}"}
        return {"failed_rank": first["rank"], "cause": failure_cause(first.get("error", "")),
                "error": f"rank {first['rank']} failed in step "
                                                       f"{first.get('step', 0) + 1}: {first.get('error')}"}
    if exit_code is not None:
        missing = [r for r in expected if ranks.get(r, {}).get("status") != "ok"]
        if missing:
            return {"failed_rank": missing[0], "cause": "ended",
                    "error": f"rank {missing[0]} ended without finishing (launcher exit code {exit_code})"}
    return None


def failure_cause(message: str) -> str:
    """A rank's own error, by kind: "disk full" is never retried (compare/launch/restarts.py)."""
    return "disk full" if "No space left on device" in message or "Errno 28" in message else "failed"


def is_peer_error(message: str) -> bool:
    """Errors a rank raises because a peer is gone or silent, not because of its own fault."""
    text = message.lower()
    return any(word in text for word in ("timed out", "timeout", "connection", "broken pipe", "peer", "sigterm"))


def slowest(ranks: dict, world) -> int:
    for rank in (range(world) if isinstance(world, int) else world):
        if rank not in ranks:
            return rank
        if process_state(ranks[rank].get("pid")) == "T":
            return rank
    return min(ranks, key=lambda r: (ranks[r].get("step", 0), ranks[r].get("heartbeat", 0)))


def process_state(pid: int | None) -> str | None:
    """Linux state letter (R, S, T stopped, Z zombie) or None when gone; "?" where /proc is absent."""
    if not pid:
        return "?"
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None
    except OSError:
        try:
            os.kill(pid, 0)
            return "?"
        except ProcessLookupError:
            return None
        except PermissionError:
            return "?"


def read_ranks(run_dir: Path, world) -> dict[int, dict]:
    """Status files of ranks 0..world-1, or of the rank ids in `world` when it is a list."""
    ranks = {}
    for rank in (range(world) if isinstance(world, int) else world):
        data = read_json(run_dir / "ranks" / f"rank{rank}.json")
        if data:
            ranks[rank] = data
    return ranks


class Interrupted(KeyboardInterrupt):
    """dpcompare itself got SIGINT, SIGTERM or SIGHUP: stop the job, mark it interrupted, exit 128+signum."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.detail: str | None = None  # what was stopped, filled in on the way out


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def install_stop_handlers() -> dict:
    """Turn the first stop signal into Interrupted; later ones are ignored so the cleanup is not cut short
    (it is bounded by 2 x KILL_GRACE_S). Returns the previous handlers, for restore_handlers."""
    if threading.current_thread() is not threading.main_thread():  # signal.signal works there only
        return {}
    stopping = []

    def handler(signum, frame):
        if not stopping:
            stopping.append(signum)
            raise Interrupted(signum)

    return {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}


def restore_handlers(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def stop_job(proc: subprocess.Popen, run_dir: Path, reason: str | None = None) -> None:
    """SIGTERM the job's process group and every known rank, then SIGKILL what is left.

    `reason`: dpcompare was stopped, not the job failing; the ranks are told first (ranks/stop.json) so
    they record "interrupted", and ranks killed before they could say so are marked so afterwards."""
    if reason:
        request_stop(run_dir, reason)
    # Only ranks on this host: another host's pid (srun over several nodes, a hostfile) names another process here.
    here = os.uname().nodename
    pids = {info.get("pid") for info in read_ranks(run_dir, 4096).values() if info.get("host", here) == here} - {None}
    targets = [("group", proc.pid)] + [("pid", p) for p in pids]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for kind, ident in targets:
            try:
                if kind == "group":
                    os.killpg(ident, sig)
                else:
                    os.kill(ident, signal.SIGCONT)  # a stopped rank cannot act on SIGTERM
                    os.kill(ident, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.time() + KILL_GRACE_S
        while time.time() < deadline and (proc.poll() is None or any(process_state(p) not in (None, "Z") for p in pids)):
            time.sleep(0.05)
    proc.wait()
    if reason:
        mark_interrupted(run_dir, reason)


def mark_interrupted(run_dir: Path, reason: str) -> None:
    """Status files of ranks that were SIGKILLed mid-step (or blocked in a collective) still say running."""
    for path in (Path(run_dir) / "ranks").glob("rank*.json"):
        info = read_json(path)
        if info and info.get("status") in ("starting", "running"):
            write_json(path, {**info, "status": "interrupted", "error": f"stopped: {reason}"})


def progress_bar(cfg: RunConfig):
    if cfg.quiet:
        return None
    from tqdm import tqdm

    # disable=None turns the bar off when stderr is not a terminal (CI logs, pipes).
    return tqdm(total=cfg.steps, desc=f"{cfg.framework} x{cfg.nproc * cfg.nnodes}", unit="step",
                disable=None, leave=False, dynamic_ncols=True)

