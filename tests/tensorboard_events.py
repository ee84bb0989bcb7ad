"""TensorBoard's event files read back with TensorBoard's own reader: what both lanes' --report-to tests judge.
Importing this module skips the importing test file where tensorboard is not installed."""
import pytest

event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator",
    reason="tensorboard is not installed (pip install -e '.[dev]' installs it)")


def read_events(logdir) -> dict[str, list[tuple[int, float]]]:
    """{scalar tag: [(step, value), ...]} of the event files in `logdir`."""
    events = event_accumulator.EventAccumulator(str(logdir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
