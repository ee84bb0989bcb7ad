"""--report-to tensorboard: every run's metrics as event files that TensorBoard's own reader opens."""
import json

import pytest

from helpers import FAST, dpcompare
from test_parity import make_run
from compare.report.tracking import report_run

event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator",
    reason="tensorboard is not installed (pip install -e '.[dev]' installs it)")


def read_events(logdir):
    events = event_accumulator.EventAccumulator(str(logdir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_event_files_hold_every_step_and_eval(tmp_path):
    run = make_run(tmp_path, "mlx", 2, evals={20: 3.1, 40: 2.9})
    report_run(run, "tensorboard")
    report_run(run, "tensorboard")  # written again whole, as after a resume: no duplicate steps
    scalars = read_events(run / "tensorboard")
    assert set(scalars) == {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "eval/loss"}
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    assert [s for s, _ in scalars["train/loss"]] == [s for s, _ in losses]
    assert all(abs(a - b) <= 1e-6 * abs(b) for (_, a), (_, b) in zip(scalars["train/loss"], losses))
    assert [s for s, _ in scalars["eval/loss"]] == [20, 40]


@pytest.mark.slow
def test_a_run_with_report_to_tensorboard_writes_event_files(cache_dir, tmp_path):
    out = tmp_path / "run"
    dpcompare("run", *FAST, "--framework", "torch", "--steps", 4, "--eval-every", 2, "--report-to", "tensorboard",
              "--out", out, cache_dir=cache_dir)
    scalars = read_events(out / "tensorboard")
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3, 4]
    assert [s for s, _ in scalars["eval/loss"]] == [2, 4]


def test_an_unknown_tracker_is_a_user_error(cache_dir, tmp_path):
    proc = dpcompare("run", *FAST, "--report-to", "tensorbored", "--out", tmp_path / "x", cache_dir=cache_dir,
                     check=False)
    assert proc.returncode == 2 and "report_to 'tensorbored'" in proc.stderr
