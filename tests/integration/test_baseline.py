"""Golden baselines: a setup saved once is judged against later, run by run, and a change of the
numbers or of the config is named."""
import json

import pytest

from helpers import FAST, dpcompare


@pytest.mark.slow
def test_compare_saves_a_baseline_then_fails_strictly_against_a_changed_lr(cache_dir, tmp_path):
    setup = [*FAST, "--frameworks", "torch", "--nproc", "1", "--steps", "5", "--strict"]
    golden = tmp_path / "golden.json"
    dpcompare("compare", *setup, "--out", tmp_path / "a", "--save-baseline", golden, cache_dir=cache_dir)
    assert json.loads(golden.read_text())["runs"][0]["framework"] == "torch"
    same = dpcompare("compare", *setup, "--out", tmp_path / "b", "--against", golden, cache_dir=cache_dir)
    assert "matches its baseline" in same.stdout
    changed = dpcompare("compare", *setup, "--lr", "3e-3", "--out", tmp_path / "c", "--against", golden,
                        cache_dir=cache_dir, check=False)
    assert changed.returncode == 3, changed.stderr
    assert "lr 0.0003 -> 0.003" in changed.stdout + changed.stderr
