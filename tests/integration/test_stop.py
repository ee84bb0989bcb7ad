"""No orphaned ranks: a signal to the dpcompare process alone (kill, timeout, CI, systemd, a closed ssh
session, the OOM killer) ends the whole job within 10 s: launcher and ranks, with the run marked
interrupted and the last complete checkpoint kept, from which --resume continues exactly."""
import json
import signal

import numpy as np
import pytest

from common.checkpoint.store import latest_checkpoint
from common.metrics import read_metrics
from helpers import FAST, can_emulate_links, dpcompare, losses, namespaces, summary
from integration.jobs import (ENDLESS, LAUNCHES, STOP_LIMIT_S, rank_statuses, said, signal_and_time, skip_unless_available,
                              start, wait_for_ranks)

EVERY = 8  # the resumed stop test's checkpoints: the steps after the last one before the stop are its reference


# SIGTERM on every launcher, with the resume; SIGHUP once, on MLX's ring over an emulated link. dpcompare turns
# either signal into the same stop (compare/launch/watchdog.py: STOP_SIGNALS, stop_job SIGTERMs the job's
# ranks whichever it got), so SIGHUP on every launcher repeated the SIGTERM cases; SIGHUP to torch's gloo
# launcher is stopped in test_pp.py's pipeline stop test, a run it makes anyway.
STOPS = [(*launch, signal.SIGTERM) for launch in LAUNCHES] + [("mlx", "ring", signal.SIGHUP)]


@pytest.mark.slow
@pytest.mark.parametrize("framework, backend, sig", STOPS,
                         ids=[f"{fw}-{backend}-{sig.name}" for fw, backend, sig in STOPS])
def test_a_stop_signal_to_dpcompare_ends_the_job_marks_it_interrupted_and_resume_is_exact(
        framework, backend, sig, cache_dir, tmp_path):
    skip_unless_available(backend)
    job = ("--framework", framework, "--nproc", 2, "--backend", backend)
    # MLX's ring is stopped over an emulated link where this machine can make one: its namespaces go too.
    link = ("--link", "1gbit") if (backend, sig) == ("ring", signal.SIGHUP) and can_emulate_links() else ()
    out = tmp_path / "run"
    proc = start(cache_dir, "run", *job, *link, *ENDLESS, "--checkpoint-every", EVERY, "--out", out)
    wait_for_ranks(out, min_step=EVERY + 1)  # checkpoint EVERY is complete
    exited, gone, stderr = signal_and_time(proc, out, sig)
    if link:  # the names this run's link recorded (another test's may exist meanwhile)
        made = summary(out)["link"]["namespaces"]
        assert made and not set(made) & set(namespaces())
    print(f"{framework}/{backend} {sig.name}: dpcompare exited after {exited:.2f} s, job gone after {gone:.2f} s")
    assert proc.returncode == 128 + sig, stderr
    assert exited < STOP_LIMIT_S and gone < STOP_LIMIT_S
    assert f"interrupted by {sig.name}" in stderr and len(said(stderr)) == 1, stderr
    assert summary(out)["status"] == "interrupted"
    assert rank_statuses(out) == ["interrupted", "interrupted"]
    if sig != signal.SIGTERM:  # the resume check once per backend keeps the suite short
        return
    # --resume from the last complete checkpoint gives the losses of a run never interrupted: those the stopped
    # run itself recorded after that checkpoint, before the signal. Only where it was stopped at the checkpoint's
    # own step (about 1 in EVERY) is there none, and an uninterrupted reference run is trained.
    train_rows = read_metrics(out / "metrics.jsonl")[0]  # a line torn by the stop is left out
    before = {row["step"]: row["loss"] for row in train_rows if "loss" in row}
    resumed_from = int(latest_checkpoint(out).name.split("_")[1])
    steps = ("--steps", resumed_from + 4, "--lr-decay-steps", 40, "--checkpoint-every", EVERY)
    dpcompare("run", *FAST, *job, *steps, "--resume", "--out", out, cache_dir=cache_dir)
    assert json.loads((out / "ranks" / "rank0.json").read_text())["start_step"] == resumed_from
    assert summary(out)["status"] == "ok" and len(losses(out)) == resumed_from + 4
    after = dict(enumerate(losses(out), start=1))
    overlap = sorted(set(before) & set(range(resumed_from + 1, resumed_from + 5)))
    print(f"{framework}/{backend}: resumed from step {resumed_from}, stopped at {max(before)}; judged on steps "
          f"{overlap or 'of a reference run'}")
    if overlap:
        np.testing.assert_allclose([after[s] for s in overlap], [before[s] for s in overlap], rtol=0, atol=1e-6)
    else:
        dpcompare("run", *FAST, *job, *steps, "--out", tmp_path / "reference", cache_dir=cache_dir)
        np.testing.assert_allclose(losses(out), losses(tmp_path / "reference"), rtol=0, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("framework, backend", LAUNCHES)
def test_a_killed_dpcompare_leaves_no_rank_running_and_the_last_checkpoint_intact(
        framework, backend, cache_dir, tmp_path):
    skip_unless_available(backend)
    out = tmp_path / "run"
    proc = start(cache_dir, "run", "--framework", framework, "--nproc", 2, "--backend", backend, *ENDLESS,
                 "--out", out)
    wait_for_ranks(out)
    _, gone, _ = signal_and_time(proc, out, signal.SIGKILL)
    print(f"{framework}/{backend} SIGKILL: job gone after {gone:.2f} s")
    assert gone < STOP_LIMIT_S
    assert rank_statuses(out) == ["interrupted", "interrupted"]  # each rank saw its supervisor gone
    from safetensors.numpy import load_file

    latest = latest_checkpoint(out)
    assert json.loads((latest / "state.json").read_text())["step"] >= 2
    for name in ("model.safetensors", "optimizer.safetensors"):
        assert all(np.isfinite(v).all() for v in load_file(str(latest / name)).values())


@pytest.mark.slow
def test_sigterm_of_compare_stops_the_matrix_without_writing_a_report(cache_dir, tmp_path):
    out = tmp_path / "cmp"
    proc = start(cache_dir, "compare", "--frameworks", "mlx,torch", "--nproc", 2, *ENDLESS, "--out", out)
    wait_for_ranks(out / "mlx-n2")
    exited, gone, stderr = signal_and_time(proc, out / "mlx-n2", signal.SIGTERM)
    print(f"compare SIGTERM: dpcompare exited after {exited:.2f} s, job gone after {gone:.2f} s")
    assert proc.returncode == 143 and exited < STOP_LIMIT_S and gone < STOP_LIMIT_S, stderr
    assert summary(out / "mlx-n2")["status"] == "interrupted"
    assert rank_statuses(out / "mlx-n2") == ["interrupted", "interrupted"]
    assert not (out / "torch-n2").exists(), "the next run of the matrix was started"
    assert not (out / "report.md").exists() and not (out / "summary.json").exists()
    assert f"dpcompare report {out}" in stderr
    report = dpcompare("report", out, cache_dir=cache_dir)  # still works on what there is
    assert "interrupted" in (out / "report.md").read_text(), report.stdout
