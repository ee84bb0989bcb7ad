"""--report-to tensorboard: every run's metrics as event files that TensorBoard's own reader opens."""
from tensorboard_events import read_events


def test_a_run_with_report_to_tensorboard_writes_event_files(matrix):
    out = matrix.run("torch", 1)  # the matrix ran with --report-to tensorboard
    scalars = read_events(out / "tensorboard")
    assert [s for s, _ in scalars["train/loss"]] == list(range(1, matrix.steps + 1))
    assert [s for s, _ in scalars["eval/loss"]] == list(range(matrix.eval_every, matrix.steps + 1, matrix.eval_every))
