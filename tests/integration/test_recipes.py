"""Recipes end to end (common/recipes.py, docs/recipes.md): mlx-lm's recipe run in both frameworks at 1 and 2 ranks,
judged like any pair (MLX vs torch within 1e-4; N=2 vs N=1 "differs", its per-rank normalization); and
`compare --recipes mlx-lm,trl`'s chain, whose contributions table has a row per differing choice summing to the
whole gap. At `tiny`, 6 steps, on prompt/completion records with --mask-prompt. (The choices' arithmetic in-process:
tests/unit/test_recipe_choices.py; the recipes' values and the table's sum: tests/unit/test_recipes.py.)"""
import numpy as np
import pytest

from helpers import FAST, dpcompare, losses, summary
from integration.records import pairs

pytestmark = pytest.mark.slow

STEPS = 6


def flags(tmp_path):
    return (*FAST, "--dataset", pairs(tmp_path), "--mask-prompt", "--steps", STEPS, "--profile-steps", 0,
            "--no-samples", "--no-link-probe")


def test_mlx_lm_s_recipe_runs_alike_in_both_frameworks_and_its_n_vs_1_differs_by_its_normalization(cache_dir,
                                                                                                    tmp_path):
    out = tmp_path / "mlx-lm"
    dpcompare("compare", *flags(tmp_path), "--recipe", "mlx-lm", "--frameworks", "mlx,torch", "--nproc", "1,2",
              "--out", out, cache_dir=cache_dir, timeout=600)
    judged = {tuple(p["pair"].split(" vs ")): p["verdict"] for p in summary(out)["verdicts"]["pairs"]}
    for n in (1, 2):
        assert judged[(f"mlx x{n}", f"torch x{n}")] == "pass", judged
        np.testing.assert_allclose(losses(out / f"mlx-n{n}"), losses(out / f"torch-n{n}"), rtol=0, atol=1e-4)
    for framework in ("mlx", "torch"):
        assert judged[(f"{framework} x2", f"{framework} x1")] == "differs", judged
    config = summary(out / "torch-n2")["config"]
    assert (config["recipe"], config["bias_correction"], config["mask_convention"], config["padding_rule"],
            config["loss_normalization"], config["lr_schedule"], config["data_order"]) == (
        "mlx-lm", False, "mlx-lm", "mlx-lm", "per-rank", "constant", "mlx-lm")


def test_the_chain_from_mlx_lm_to_trl_explains_the_gap_choice_by_choice(cache_dir, tmp_path):
    """Four choices left to differ (the flags fix the others on both sides), in MLX at one rank (its ranks start in
    0.6 s, torch's in 3 s): five runs. torch's side of these choices is the test above's (and the unit lane's)."""
    out = tmp_path / "chain"
    fixed = ("--data-order", "dpcompare", "--padding-rule", "seq-len", "--lora-targets", "q_proj,v_proj", "--lora-layers", 0, "--optimizer",
             "adamw", "--lr-schedule", "constant", "--grad-clip", 0, "--loss-normalization", "global-tokens",
             "--lora-scale-convention", "direct")
    proc = dpcompare("compare", *flags(tmp_path), "--recipes", "mlx-lm,trl", *fixed, "--frameworks", "mlx",
                     "--nproc", 1, "--out", out, cache_dir=cache_dir, timeout=600)
    table = summary(out)["contributions"]
    assert table["recipes"] == ["mlx-lm", "trl"]
    assert table["order"] == ["mask_convention", "lora_alpha", "bias_correction", "lr"]
    (t,) = table["tables"]
    assert len(t["rows"]) == 4 and t["steps"] == {"last": STEPS, "middle": STEPS // 2}
    a, b = losses(out / "links" / "00-mlx-lm" / "mlx-n1"), losses(out / "links" / "04-lr-trl" / "mlx-n1")
    for key, step in (("loss_last", STEPS), ("loss_middle", STEPS // 2)):
        assert abs(sum(r[key] for r in t["rows"]) - (b[step - 1] - a[step - 1])) <= 1e-6
        assert all(abs(r[key]) > 1e-7 for r in t["rows"]), t["rows"]  # each of the four moves the loss
    largest = max(t["rows"], key=lambda r: abs(r["loss_last"]))["choice"]
    assert f"the largest contributor is {largest}" in proc.stdout
    assert "rows sum to the whole gap" in (out / "report.md").read_text()
    assert (out / "links" / "04-lr-trl" / "report.md").is_file()  # B's own report
