"""--report-to tensorboard: every run's metrics as event files that TensorBoard's own reader opens."""

import pytest

from helpers import FAST, dpcompare

event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator",
    reason="tensorboard is not installed (pip install -e '.[dev]' installs it)")


def read_events(logdir):
    events = event_accumulator.EventAccumulator(str(logdir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


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
