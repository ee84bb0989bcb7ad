"""`compare --recipe-from RUN_A,RUN_B` (compare/recipe_from.py) on the real mlx_lm.lora and Trainer + peft runs of
tests/fixtures/imported_runs/: each run against its reproduction, MLX against torch under each recipe, and the
logged gap at the last step split into rows (A's run to its reproduction, the chain's choices, MLX to torch under
recipe B, B's reproduction to B's run) that sum to it. One compare at the smallest shapes: --preset tiny stands in
for the runs' model, and flags fix all but two choices on both sides, so the chain is two links (alpha 10 vs 16), four runs."""
import json

from compare.cli import main
from helpers import FAST, dpcompare
from integration.records import pairs

FIXTURES = __import__("pathlib").Path(__file__).resolve().parents[1] / "fixtures" / "imported_runs"


def test_your_two_runs_are_reproduced_in_both_frameworks_and_the_gap_rows_sum_to_the_logged_gap(cache_dir, tmp_path,
                                                                                                  capsys):
    recipe_a = tmp_path / "a.json"  # import-run with the console log: the mlx-lm run's logged curve comes along
    assert main(["import-run", str(FIXTURES / "mlx-lm"), "--log", str(FIXTURES / "mlx-lm" / "mlx-console.log"),
                 "--out", str(recipe_a)]) == 0
    capsys.readouterr()
    fixed = ("--data-order", "dpcompare", "--mask-convention", "exact", "--padding-rule", "seq-len",
             "--loss-normalization", "global-tokens", "--lora-scale-convention", "alpha-over-rank", "--lora-layers", 0,
             "--optimizer", "adamw", "--bias-correction", "--lr-schedule", "linear", "--warmup-steps", 0, "--grad-clip", 1.0)
    out = tmp_path / "yours"
    proc = dpcompare("compare", *FAST, "--dataset", pairs(tmp_path), "--profile-steps", 0, "--no-samples",
                     "--recipe-from", f"{recipe_a},{FIXTURES / 'trainer'}", *fixed, "--frameworks", "mlx,torch",
                     "--nproc", 1, "--out", out, cache_dir=cache_dir, timeout=600)
    section = json.loads((out / "your_runs.json").read_text())
    gap = section["gap"]
    # run A logged steps 2, 4, 6 (every 2), run B every step: the last in common is 6; one choice left: one row
    assert gap["step"] == 6 and [r["row"] for r in gap["rows"] if r["kind"] == "recipe"] == ["recipe: lora-alpha"]
    assert gap["logged"] == {"A": 6.145, "B": json.loads((FIXTURES / "trainer/trainer_state.json").read_text())
                             ["log_history"][5]["loss"]}
    assert abs(gap["rows_sum"] - gap["gap"]) <= 1e-12 and abs(gap["recipes"] + gap["remainder"] - gap["gap"]) <= 1e-12
    framework_row = next(r for r in gap["rows"] if r["row"].startswith("MLX -> torch"))
    assert abs(framework_row["delta"]) <= 1e-4  # the frameworks' share, measured on identical batches
    for pair in section["pairs"]:  # the reproduction per logged step, judged on the curve tolerance
        assert pair["verdict"] in ("pass", "differs") and pair["points"] and pair["mlx_vs_torch_max_abs"] <= 1e-4
    assert [len(p["points"]) for p in section["pairs"]] == [3, 6]
    report = (out / "report.md").read_text()
    assert "## Your runs against their reproductions" in report and "rows + remainder" in report
    assert "Your runs against their reproductions" in (out / "report.html").read_text()
    assert json.loads((out / "summary.json").read_text())["your_runs"]["gap"]["rows_sum"] == gap["rows_sum"]
    assert (out / "plots" / "your-runs.png").is_file() and "The gap at step 6" in proc.stdout
