"""Faults: a killed, crashed or stopped rank ends the whole job quickly with a message naming it; NaN
stops the run and keeps the last good checkpoint; resume is exact; checkpoints are refused when wrong."""
import json
import os
import signal
import time

import numpy as np
import pytest

from helpers import FAST, can_emulate_links, dpcompare, losses, namespaces, summary
from integration.jobs import LAUNCHES, alive, all_rank_pids, skip_unless_available, start, wait_for_rank
from integration.runs import HORIZON, resumed_from, rewound

pytestmark = pytest.mark.slow

@pytest.mark.parametrize("framework, backend", LAUNCHES)
def test_a_killed_rank_ends_the_job_within_60_s_naming_the_rank(framework, backend, cache_dir, tmp_path):
    skip_unless_available(backend)
    out = tmp_path / "run"
    proc = start(cache_dir, "run", "--out", out, "--framework", framework, "--nproc", 2, "--backend", backend,
                 "--steps", 100000)
    victim = wait_for_rank(out, 1)
    killed_at = time.time()
    os.kill(victim["pid"], signal.SIGKILL)
    _, stderr = proc.communicate(timeout=90)
    elapsed = time.time() - killed_at
    print(f"{framework}/{backend}: kill -> exit in {elapsed:.1f} s")
    assert proc.returncode != 0
    assert elapsed < 60
    assert "rank 1" in stderr, stderr
    assert not any(alive(pid) for pid in all_rank_pids(out)), "no process of the job is left"
    assert json.loads((out / "summary.json").read_text())["status"] == "failed"


@pytest.mark.parametrize("framework, backend", LAUNCHES)
def test_a_stopped_rank_ends_the_job_after_the_collective_timeout(framework, backend, cache_dir, tmp_path):
    skip_unless_available(backend)
    out = tmp_path / "run"
    proc = start(cache_dir, "run", "--out", out, "--framework", framework, "--nproc", 2, "--backend", backend,
                 "--steps", 100000, "--collective-timeout-s", 5)
    victim = wait_for_rank(out, 1)
    stopped_at = time.time()
    os.kill(victim["pid"], signal.SIGSTOP)
    try:
        _, stderr = proc.communicate(timeout=90)
    finally:
        for pid in all_rank_pids(out):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    elapsed = time.time() - stopped_at
    print(f"{framework}/{backend}: SIGSTOP -> exit in {elapsed:.1f} s")
    assert proc.returncode != 0 and elapsed < 30
    assert "rank 1" in stderr, stderr


@pytest.mark.parametrize("framework", ["mlx", "torch"])
def test_nan_loss_stops_the_run_naming_the_step_and_keeps_the_last_good_checkpoint(framework, cache_dir, tmp_path):
    out = tmp_path / "run"
    proc = dpcompare("run", *FAST, "--framework", framework, "--out", out, "--steps", 20, "--lr", "1e30",
                     "--warmup-steps", 0, "--checkpoint-every", 1, cache_dir=cache_dir, check=False)
    assert proc.returncode == 1
    assert "step" in proc.stderr and ("nan" in proc.stderr.lower() or "finite" in proc.stderr.lower()), proc.stderr
    from common.checkpoint.store import latest_checkpoint
    from common.model.weights import load_pretrained

    ckpt = latest_checkpoint(out)
    if ckpt is not None:  # whatever was saved must be loadable and finite
        _, weights = load_pretrained(ckpt)
        assert all(np.isfinite(w).all() for w in weights.values())


# torch at 1 rank is left out to keep CI short: its checkpoint code is the same as at 2 ranks.
@pytest.mark.parametrize("framework, world", [("mlx", 1), ("mlx", 2), ("torch", 2)])
def test_resume_is_exact_sampler_schedule_and_optimizer_state_all_continue(framework, world, uninterrupted, cache_dir,
                                                                          tmp_path):
    # The session's 20-step ddp run of these flags (integration/conftest.py) never stopped; its step-10
    # checkpoint, copied, is resumed to step 20 in a new process and must give the same losses.
    straight = uninterrupted(framework, "ddp", world)
    resumed = rewound(straight, tmp_path / "b")
    dpcompare("run", *FAST, "--framework", framework, "--nproc", world, *HORIZON, "--steps", 20, "--resume",
              "--out", resumed, cache_dir=cache_dir)
    assert resumed_from(resumed) == 10  # resumed, not retrained
    np.testing.assert_allclose(losses(resumed), losses(straight), rtol=0, atol=1e-6)


# The refusals and the interrupted save start from a copy of a session run (integration/conftest.py), as the
# resume test above does: what they check is the resume, not the training before it.
def test_a_truncated_checkpoint_is_refused_and_left_untouched(uninterrupted, cache_dir, tmp_path):
    out = rewound(uninterrupted("mlx", "ddp", 1), tmp_path / "run", step=20)  # checkpoints 10 and 20
    weights = out / "checkpoints" / "step_000020" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    proc = dpcompare("run", *FAST, "--framework", "mlx", *HORIZON, "--steps", 24, "--resume", "--out", out,
                     cache_dir=cache_dir, check=False)
    assert proc.returncode == 2 and "truncated" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert before == {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}


def test_a_checkpoint_of_another_model_is_refused(uninterrupted, cache_dir, tmp_path):
    out = rewound(uninterrupted("torch", "ddp", 1), tmp_path / "run", step=20)
    proc = dpcompare("run", *FAST, "--framework", "torch", *HORIZON, "--steps", 24, "--resume", "--out", out,
                     "--set", "model.n_layers=3", cache_dir=cache_dir, check=False)
    assert proc.returncode == 2 and "another model spec" in proc.stderr


def test_an_interrupted_save_leaves_the_previous_checkpoint_as_latest(uninterrupted, cache_dir, tmp_path):
    out = rewound(uninterrupted("mlx", "ddp", 1), tmp_path / "run")  # stopped at its step-10 checkpoint
    # What a kill during the save of step 12 leaves behind: a half-written temporary directory.
    partial = out / "checkpoints" / ".tmp_step_000012_12345"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"\x00" * 100)
    dpcompare("run", *FAST, "--framework", "mlx", *HORIZON, "--steps", 12, "--checkpoint-every", 2, "--resume",
              "--out", out, cache_dir=cache_dir)
    assert resumed_from(out) == 10
    assert [json.loads(l)["step"] for l in (out / "metrics.jsonl").read_text().splitlines()] == list(range(1, 13))


@pytest.mark.parametrize("framework, backend", LAUNCHES)
def test_a_crashing_rank_ends_the_job_with_its_error_naming_the_rank(framework, backend, cache_dir, tmp_path):
    """torch's ranks talk over an emulated link where this machine can make one (root, iproute2): a failed
    rank must also leave no network namespace behind, and the summary records the shaped path."""
    skip_unless_available(backend)
    link = ["--link", "1gbit"] if backend == "gloo" and can_emulate_links() else []
    out = tmp_path / "run"
    started = time.time()
    proc = dpcompare("run", *FAST, "--framework", framework, "--nproc", 2, "--backend", backend, "--steps", 50,
                     *link, "--link-probe", "--out", out, cache_dir=cache_dir, check=False,
                     env={"DPCOMPARE_INJECT_FAULT": f"framework={framework},rank=1,step=4"})
    assert proc.returncode == 1 and time.time() - started < 60
    assert "rank 1 failed in step 4: RuntimeError: injected fault at step 4" in proc.stderr, proc.stderr
    assert not any(alive(pid) for pid in all_rank_pids(out))
    recorded = summary(out)["link"]
    assert recorded["allreduce"]["bandwidth_Bps"] > 0 and recorded["allreduce"]["world_size"] == 2
    if link:  # the names this run's link recorded (another test's may exist meanwhile)
        assert recorded["namespaces"] and not set(recorded["namespaces"]) & set(namespaces())
        # 1 Gbit/s shaped: the link holds both figures to its rate from above (load can only slow them; TCP
        # measured 955-963 Mbit/s on a quiet Zen 5, the gloo all-reduce of 4 MiB less, and 766 beside the other
        # xdist worker's 8-rank runs). How near the rate they come is docs/links.md's figure, not this test's.
        assert recorded["requested"] == "1gbit" and recorded["emulated"]
        assert 0 < recorded["tcp_bandwidth_Bps"] * 8 <= 1.2e9, recorded
        assert recorded["allreduce"]["bandwidth_Bps"] * 8 <= 1.2e9, recorded


def test_two_runs_at_once_do_not_collide(cache_dir, tmp_path):
    procs = [start(cache_dir, "run", "--out", tmp_path / f"run{i}", "--framework", fw, "--nproc", 2, "--steps", 8)
             for i, fw in enumerate(["mlx", "mlx", "torch", "torch"])]
    for proc in procs:
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr
    curves = [losses(tmp_path / f"run{i}") for i in range(4)]
    np.testing.assert_allclose(curves[0], curves[1], atol=0)  # same framework, same inputs: same numbers
    np.testing.assert_allclose(curves[2], curves[3], atol=0)
