"""dpcompare jobs started in the background, for the tests that kill, stop or signal them (test_faults.py,
test_stop.py, test_pp.py): start one, wait for its ranks, signal it, and find what is left of it."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from compare.machine import environment
from helpers import FAST, ROOT

LAUNCHES = [("mlx", "ring"), ("mlx", "mpi"), ("torch", "gloo")]
STOP_LIMIT_S = 10.0
# Runs are long enough never to finish on their own; the LR horizon is fixed so that a resumed run and
# its reference follow the same schedule whatever --steps they are given.
ENDLESS = ("--steps", 100000, "--lr-decay-steps", 40, "--checkpoint-every", 2)


def skip_unless_available(backend):
    if backend == "mpi" and environment.mpirun() is None:
        pytest.skip("Open MPI (mpirun) is not installed")


STARTED: list[subprocess.Popen] = []  # every background job of the running test, for stop_leftovers


def start(cache_dir, command, *args):
    """`dpcompare COMMAND --preset tiny ... ARGS` in the background, its output piped."""
    cmd = [sys.executable, "-m", "compare.cli", command, *FAST, *map(str, args)]
    env = {**os.environ, "DPCOMPARE_CACHE": str(cache_dir)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    STARTED.append(proc)
    return proc


def stop_leftovers():
    """Stop what a test started and left running (a `wait_for_rank` that timed out raises before the test
    signals its job, and an endless job would train on beside the next tests): SIGTERM, which dpcompare answers
    by stopping its ranks (test_stop.py), then SIGKILL."""
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=3 * STOP_LIMIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def wait_for_rank(out, rank, min_step=2, timeout=90):
    """Rank `rank`'s status once it has done `min_step` steps."""
    path = out / "ranks" / f"rank{rank}.json"
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            info = json.loads(path.read_text())
            if info.get("step", 0) >= min_step:
                return info
        except (OSError, json.JSONDecodeError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"rank {rank} never reached step {min_step}")


def wait_for_ranks(run_dir, world=2, min_step=3, timeout=120):
    """Until every rank has done `min_step` steps (so checkpoint step 2 is complete); a rank that failed before
    that fails the test at once, with its error, instead of at the timeout."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        steps = []
        for rank in range(world):
            try:
                status = json.loads((run_dir / "ranks" / f"rank{rank}.json").read_text())
            except (OSError, json.JSONDecodeError):
                status = {}
            if status.get("status") == "failed":
                raise AssertionError(f"rank {rank} failed before step {min_step}: {status.get('error')}")
            steps.append(status.get("step", 0))
        if min(steps) >= min_step:
            return
        time.sleep(0.1)
    raise AssertionError(f"the ranks never reached step {min_step} in {run_dir}")


def alive(pid):
    """Whether `pid` runs (a zombie does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def all_rank_pids(out):
    return [json.loads(p.read_text())["pid"] for p in (out / "ranks").glob("rank*.json")]


def rank_statuses(run_dir):
    return sorted(json.loads(p.read_text())["status"] for p in (run_dir / "ranks").glob("rank*.json"))


def descendants(pid):
    """Every process below `pid`, found through /proc's parent links (taken before the signal: after it
    the orphans are reparented)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def said(stderr: str) -> list[str]:
    """What dpcompare said on stderr, less the notes it prints before a job starts (`dpcompare: note: ...`, such
    as MLX's ring on a machine whose cores its ranks fill: compare/machine/sharing.py)."""
    return [line for line in stderr.strip().splitlines() if not line.startswith("dpcompare: note: ")]


def signal_and_time(proc, run_dir, sig):
    """Send `sig` to the dpcompare process only; (seconds to its exit, seconds until no process of the
    job is left, stderr). Leftovers are killed so that a failing test leaves nothing behind."""
    job = descendants(proc.pid) | {json.loads(p.read_text())["pid"] for p in (run_dir / "ranks").glob("rank*.json")}
    assert len(job) >= 3, f"expected a launcher and two ranks, found {job}"
    sent = time.time()
    os.kill(proc.pid, sig)
    _, stderr = proc.communicate(timeout=60)
    exited = time.time() - sent
    while any(alive(p) for p in job) and time.time() - sent < STOP_LIMIT_S + 5:
        time.sleep(0.05)
    gone = time.time() - sent
    left = [p for p in job if alive(p)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes of the job still alive {gone:.1f} s after {sig.name}: {left}"
    return exited, gone, stderr
