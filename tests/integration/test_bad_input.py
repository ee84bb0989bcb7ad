"""Bad input: an existing run is never overwritten without consent (the other bad inputs, which start no
run, are checked in-process in tests/unit/test_bad_input.py)."""
from helpers import FAST, dpcompare


def test_an_existing_run_is_never_overwritten_without_consent(tmp_path, cache_dir):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    (out / "notes.txt").write_text("mine")
    proc = dpcompare("run", "--framework", "mlx", *FAST, "--steps", "2", "--out", out, cache_dir=cache_dir, check=False)
    assert proc.returncode == 2 and "already holds a run" in proc.stderr
    assert (out / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n'
    dpcompare("run", "--framework", "mlx", *FAST, "--steps", "2", "--out", out, "--overwrite", cache_dir=cache_dir)
    assert (out / "notes.txt").read_text() == "mine", "--overwrite replaces dpcompare's files only"
