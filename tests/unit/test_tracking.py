"""--report-to tensorboard: every run's metrics as event files that TensorBoard's own reader opens."""
import json

from compare.report.tracking import report_run
from helpers import FAST, dpcompare_here
from tensorboard_events import read_events
from unit.fake_runs import make_run


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


def test_an_unknown_tracker_is_a_user_error(cache_dir, tmp_path):
    proc = dpcompare_here("run", *FAST, "--report-to", "tensorbored", "--out", tmp_path / "x", cache_dir=cache_dir)
    assert proc.returncode == 2 and "report_to 'tensorbored'" in proc.stderr
