"""benchmarks/bench_plan.py --recompute --repeat: the tables again from K kept sittings, and each layout's errors
over them, their median and how many sittings put it within 20 % (docs/scaling.md: one sitting's N=1 runs
spread as wide as the target, so a layout is judged over several). Two sittings of one compare, written as the
runner leaves them; nothing is trained. One plain Python process: about a second."""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def kept_run(compare: Path, name: str, measured_s: float, predicted_s: float | None) -> None:
    run = compare / name
    run.mkdir(parents=True)
    summary = {"framework": "torch", "world_size": int(name.rsplit("-n", 1)[1]), "status": "ok",
               "step_time_s": measured_s}
    if predicted_s is not None:
        summary["prediction"] = {"from": "torch-n1", "step_s": predicted_s}
    (run / "summary.json").write_text(json.dumps(summary))


def test_repeated_sittings_give_each_layout_its_errors_median_and_count_within_20_percent(tmp_path):
    kept = tmp_path / "kept"
    for i, (ddp_predicted, tp_predicted) in enumerate([(0.11, 0.30), (0.13, 0.26), (0.104, 0.15)]):
        compare = kept / f"rep{i}" / "none"
        kept_run(compare, "torch-n1", 0.30, None)
        kept_run(compare, "torch-n4", 0.10, ddp_predicted)      # +10 %, +30 %, +4 %
        kept_run(compare, "torch-tp-n4", 0.20, tp_predicted)    # +50 %, +30 %, -25 %
    out = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_plan.py"), "--recompute", str(kept),
                           "--repeat", "3", "--frameworks", "torch", "--links", "none", "--strategies", "ddp,tp",
                           "--nproc", "4", "--out", str(out)], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "each layout over the 3 sittings" in proc.stdout
    result = json.loads(out.read_text())
    assert sorted((r["sitting"], r["run"]) for r in result["rows"]) == [
        (i, run) for i in range(3) for run in ("torch-n4", "torch-tp-n4")]
    medians = {m["run"]: m for m in result["medians"]}
    assert medians["torch-n4"]["errors"] == "+10% +30% +4%" and medians["torch-n4"]["within"] == "2 of 3"
    assert abs(medians["torch-n4"]["median_error"] - 0.10) < 1e-9
    assert medians["torch-tp-n4"]["within"] == "0 of 3" and abs(medians["torch-tp-n4"]["median_error"] - 0.30) < 1e-9


def test_a_sitting_count_below_one_exits_2_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_plan.py"), "--repeat", "0",
                           "--out", str(tmp_path / "plan.json")], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].endswith("--repeat 0: needs 1 or more sittings")
    assert not (tmp_path / "plan.json").exists()


def test_a_kept_sitting_drops_its_runs_checkpoints_and_keeps_their_summaries_and_anything_else(tmp_path):
    """benchmarks/benchlib.py drop_checkpoints: --keep's sittings are read again from summaries alone, and one
    bench_plan_model sitting's final checkpoints took 14 GB. Only a run's own `checkpoints/` goes."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from benchlib import drop_checkpoints

    run = tmp_path / "kept" / "none" / "torch-n1"
    kept_run(tmp_path / "kept" / "none", "torch-n1", 0.3, None)
    (run / "checkpoints" / "step_000010").mkdir(parents=True)
    (run / "checkpoints" / "step_000010" / "model.safetensors").write_bytes(b"\0" * 1000)
    other = tmp_path / "kept" / "model-small" / "checkpoints"  # no summary.json beside it: not a run's
    other.mkdir(parents=True)
    (other / "config.json").write_text("{}")
    assert drop_checkpoints(tmp_path / "kept") == 1000
    assert not (run / "checkpoints").exists() and (run / "summary.json").is_file()
    assert (other / "config.json").is_file()
    assert drop_checkpoints(tmp_path / "kept") == 0
