"""Golden baselines: a setup saved once is judged against later, run by run, and a change of the
numbers or of the config is named."""
import json

from helpers import dpcompare


def test_compare_saves_a_baseline_then_fails_strictly_against_a_changed_lr(matrix, cache_dir, tmp_path):
    # The session's matrix saved the baseline of its four runs. Its torch x1 run, judged against it, matches
    # (`report --against`: that a fresh process trains the same numbers is test_faults' two-runs test); torch x1
    # is run again with another lr against it and fails strictly, naming the change.
    setup = [*matrix.setup, "--profile-steps", 0, "--frameworks", "torch", "--nproc", "1", "--strict"]
    golden = matrix.baseline
    assert "torch" in {run["framework"] for run in json.loads(golden.read_text())["runs"]}
    same = dpcompare("report", matrix.run("torch", 1), "--out", tmp_path / "b", "--against", golden, "--strict",
                     cache_dir=cache_dir)
    assert "matches its baseline" in same.stdout
    changed = dpcompare("compare", *setup, "--lr", "3e-3", "--no-samples", "--out", tmp_path / "c", "--against", golden,
                        cache_dir=cache_dir, check=False)
    assert changed.returncode == 3, changed.stderr
    assert f"lr {float(matrix.lr)} -> 0.003" in changed.stdout + changed.stderr
