"""dpcompare under a real Slurm: a single-node cluster (slurmctld, slurmd, munged) started once for this file by
tests/slurm/start-cluster.sh and always stopped. A comparison submitted with sbatch equals the same runs made
here; inside `salloc -n 2` torch (gloo) and MLX (ring, MPI) run as one srun step; scancel and Ctrl-C leave no
rank behind.
Skipped where Debian's slurm-wlm and munge are missing or the user is not root."""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from compare.launch.watchdog import process_state
from helpers import FAST, ROOT, dpcompare, losses, summary
from integration.runs import HORIZON

SCRIPTS = ROOT / "tests" / "slurm"
DAEMONS = ("munged", "slurmctld", "slurmd")
QUICK = (*FAST, *HORIZON, "--profile-steps", 0)  # the session's `uninterrupted` runs' numbers, no profile rounds


def alive(pid) -> bool:
    return process_state(pid) not in (None, "Z")


@pytest.fixture(scope="module")
def cluster():
    """The environment that reaches the test cluster (SLURM_CONF); its daemons are gone after the module."""
    missing = [tool for tool in (*DAEMONS, "sbatch", "salloc", "srun", "scancel") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"Slurm tests need Debian's slurm-wlm and munge ({', '.join(missing)} not found)")
    if os.geteuid() != 0:
        pytest.skip("Slurm tests start slurmctld, slurmd and munged as root")
    state = Path(tempfile.mkdtemp(prefix="dpc-slurm-"))  # short: munged's socket path must fit a sun_path
    try:  # a start that runs out its time is stopped too: its daemons may be up
        started = subprocess.run([SCRIPTS / "start-cluster.sh", state], capture_output=True, text=True, timeout=60)
        assert started.returncode == 0, started.stderr
        yield {**os.environ, "SLURM_CONF": str(state / "slurm.conf")}
    finally:
        pids = {name: int(pid) for name in DAEMONS
                if (pid := (state / f"{name}.pid").read_text().strip() if (state / f"{name}.pid").exists() else "")}
        stopped = subprocess.run([SCRIPTS / "stop-cluster.sh", state], capture_output=True, text=True, timeout=120)
        left = {name: pid for name, pid in pids.items() if alive(pid)}
        shutil.rmtree(state, ignore_errors=True)
        assert stopped.returncode == 0 and not left, f"daemons left running: {left}; {stopped.stderr}"


def queue(env, empty_within_s: float = 0) -> list[str]:
    """The jobs in the queue; with `empty_within_s`, once it is empty or that time has passed (a job that
    ended stays a few seconds as COMPLETING)."""
    deadline = time.time() + empty_within_s
    while True:
        jobs = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True).stdout.split()
        if not jobs or time.time() > deadline:
            return jobs
        time.sleep(0.2)


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout_s: float = 180) -> list[int]:
    """Rank 0's status file has reached `step`; the pids of every rank that has written one."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()
        ranks = [json.loads(p.read_text()) for p in sorted((run_dir / "ranks").glob("rank[0-9]*.json"))
                 if p.stat().st_size]
        if ranks and ranks[0].get("step", 0) >= step:
            return [r["pid"] for r in ranks]
        time.sleep(0.2)
    raise AssertionError(f"{run_dir}: no step {step} after {timeout_s} s")


def max_difference(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a
    return max(abs(x - y) for x, y in zip(a, b))


def test_a_comparison_submitted_with_sbatch_passes_and_equals_the_same_runs_made_here(cluster, uninterrupted,
                                                                                      cache_dir, tmp_path):
    # 8 steps of the session's 20-step runs (the same LR horizon): what is checked is the submission, not the curve
    here = {(fw, n): losses(uninterrupted(fw, "ddp", n))[:8] for fw in ("mlx", "torch") for n in (1, 2)}
    out = tmp_path / "submitted"
    proc = dpcompare("compare", *QUICK, "--steps", 8, "--frameworks", "mlx,torch", "--nproc", "1,2",
                     "--submit", "slurm", "--no-samples", "--out", out, cache_dir=cache_dir, env=cluster, timeout=400)
    assert "verdict: parity PASS" in proc.stdout
    assert (out / "report.html").is_file() and (out / "report.md").is_file()
    for (fw, n), expected in here.items():
        run_dir = out / f"{fw}-n{n}"
        assert max_difference(losses(run_dir), expected) <= 1e-7, (fw, n)
        script = (run_dir / "job.sbatch").read_text()
        assert f"#SBATCH --ntasks={n}" in script and "--launcher slurm" in script
        assert (run_dir / "log.txt").read_text().startswith(f"$ {shutil.which('srun')} --ntasks={n}")
        assert len(list(run_dir.glob("slurm-*.out"))) == 1
    assert "queued" in proc.stderr and "running" in proc.stderr and "finished" in proc.stderr
    assert queue(cluster, empty_within_s=30) == []


# MLX's ring runs inside salloc in the scancel test below, from the same weights and data.
@pytest.mark.parametrize("framework, backend", [("torch", "gloo"), ("mlx", "mpi")])
def test_inside_salloc_every_backend_runs_as_one_srun_step(cluster, uninterrupted, cache_dir, tmp_path,
                                                           framework, backend):
    from compare.machine import environment

    if backend == "mpi" and environment.libmpi() is None:
        pytest.skip("MLX's MPI backend needs Open MPI (Debian: openmpi-bin libopenmpi-dev)")
    expected = losses(uninterrupted(framework, "ddp", 2))[:3]
    out = tmp_path / "run"
    proc = subprocess.run(["salloc", "-n", "2", sys.executable, "-m", "compare.cli", "run", *map(str, QUICK),
                           "--framework", framework, "--backend", backend, "--steps", "3", "--out", str(out)],
                          env={**cluster, "DPCOMPARE_CACHE": str(cache_dir)}, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr + (out / "log.txt").read_text()
    result = summary(out)
    assert (result["world_size"], result["backend"], result["status"]) == (2, backend, "ok")
    assert result["command"].startswith(shutil.which("srun"))  # the job's task count, without --nproc
    assert ("--mpi=pmix" in result["command"]) == (backend == "mpi")
    # MPI's all-reduce adds in another order than the ring's: equal to float32 rounding.
    assert max_difference(losses(out), expected) <= (1e-6 if backend == "mpi" else 1e-7)


def test_scancel_stops_every_rank_and_the_run_is_interrupted(cluster, uninterrupted, cache_dir, tmp_path):
    """An MLX ring inside salloc, cancelled. salloc does not signal its command when the job is cancelled:
    dpcompare sees the ranks' step end with the allocation, stops as if signalled, and exits 128 + SIGTERM."""
    expected = losses(uninterrupted("mlx", "ddp", 2))
    out = tmp_path / "cancelled"
    proc = subprocess.Popen(["salloc", "-n", "2", sys.executable, "-m", "compare.cli", "run", *map(str, QUICK),
                             "--framework", "mlx", "--steps", "5000", "--out", str(out)],
                            env={**cluster, "DPCOMPARE_CACHE": str(cache_dir)}, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        ranks = wait_for_step(out, 3, proc)
        assert len(ranks) == 2
        subprocess.run(["scancel", *queue(cluster)], env=cluster, check=True)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    result = summary(out)
    assert result["status"] == "interrupted" and "interrupted by SIGTERM" in result["error"]
    assert result["backend"] == "ring" and result["command"].startswith(shutil.which("srun"))
    assert not [pid for pid in ranks if alive(pid)]
    assert queue(cluster, empty_within_s=30) == []
    steps = losses(out)[:len(expected)]  # the same steps as here, up to where the cosine horizon ends
    assert len(steps) >= 3 and max_difference(steps, expected[:len(steps)]) <= 1e-7


def test_ctrl_c_cancels_the_submitted_jobs_and_each_run_says_interrupted(cluster, cache_dir, tmp_path):
    out = tmp_path / "stopped"
    proc = subprocess.Popen([sys.executable, "-m", "compare.cli", "compare", *map(str, QUICK), "--frameworks",
                             "mlx", "--nproc", "2", "--steps", "5000", "--submit", "slurm", "--no-samples",
                             "--out", str(out)], env={**cluster, "DPCOMPARE_CACHE": str(cache_dir)}, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ranks = wait_for_step(out / "mlx-n2", 2, proc)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGINT, stderr
    assert "cancelling job" in stderr
    assert queue(cluster, empty_within_s=30) == []
    result = summary(out / "mlx-n2")
    assert result["status"] == "interrupted"  # written by the job's dpcompare, on scancel's SIGTERM
    assert not [pid for pid in ranks if alive(pid)]
