"""dpcompare started outside the checkout, given only relative paths: the ranks (which run in the project's
directory) still find everything, and the report, export and plan commands take relative run directories.
tests/unit/test_paths.py covers how each path is resolved; this is the end to end of it, one small compare."""
import json

from helpers import FAST, ROOT, dpcompare


def test_compare_report_and_export_from_a_scratch_directory_with_only_relative_paths(tmp_path, cache_dir):
    scratch = tmp_path / "scratch"  # a pytest temporary directory: outside the checkout
    (scratch / "configs").mkdir(parents=True)
    assert not scratch.is_relative_to(ROOT)
    (scratch / "cache").symlink_to(cache_dir)  # the session's cache, named relative to the config file below
    (scratch / "configs" / "run.toml").write_text('cache_dir = "../cache"\nsteps = 3\n')
    here = {"cache_dir": cache_dir, "cwd": scratch}
    proc = dpcompare("compare", *FAST, "--config", "configs/run.toml", "--frameworks", "mlx,torch", "--nproc", 1,
                     "--profile-steps", 0, "--no-samples", "--out", "rel", **here)
    assert "verdict: parity PASS" in proc.stdout
    summary = json.loads((scratch / "rel" / "summary.json").read_text())
    assert [r["run_dir"] for r in summary["runs"]] == [str(scratch / "rel" / d) for d in ("mlx-n1", "torch-n1")]
    plan = json.loads((scratch / "rel" / "torch-n1" / "run_config.json").read_text())
    assert plan["config"]["out"] == str(scratch / "rel" / "torch-n1")
    assert plan["config"]["cache_dir"] == str(scratch / "cache")  # from the TOML, relative to configs/

    dpcompare("report", "rel/mlx-n1", "rel/torch-n1", "--out", "again", **here)
    assert json.loads((scratch / "again" / "summary.json").read_text())["verdicts"]["all_pass"] is True
    dpcompare("export", "rel/torch-n1", "--out", "exported", **here)
    assert json.loads((scratch / "exported" / "config.json").read_text())["num_hidden_layers"] > 0
    proc = dpcompare("export", "rel/nowhere", "--out", "x", check=False, **here)
    assert proc.returncode == 2 and f"rel/nowhere (resolved: {scratch / 'rel' / 'nowhere'}) does not exist" in proc.stderr
