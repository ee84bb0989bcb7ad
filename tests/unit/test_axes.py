"""The strategy and dtype axes: which runs are judged against which, with which tolerances, and how
`compare` plans a matrix (names, runs left out, every output directory checked before anything trains).

Run directories are synthetic but written with the real schema (tests/unit/fake_runs.py).
"""
from __future__ import annotations


import pytest

from common.config import RunConfig
from common.errors import UserError
from compare.report.labels import run_dirname, run_label
from compare.matrix import expand_matrix
from compare.report.parity import Tolerances
from compare.report.writer import write_report
from helpers import FAST, dpcompare_here
from unit.fake_runs import judged, make_run, reference_losses


def scaled(factor: float, from_step: int = 1) -> list[float]:
    return [x * (factor if s >= from_step else 1.0) for s, x in enumerate(reference_losses(), start=1)]


def test_default_strategy_and_dtype_keep_the_old_names_and_others_are_spelled_out():
    assert (run_label("mlx", 2), run_dirname("mlx", 2)) == ("mlx x2", "mlx-n2")
    assert (run_label("torch", 2, "fsdp", "bfloat16"), run_dirname("torch", 2, "fsdp", "bfloat16")) == \
        ("torch fsdp bf16 x2", "torch-fsdp-bf16-n2")


def test_fsdp_is_judged_against_ddp_at_the_same_world_size_and_fails_on_a_real_difference(tmp_path):
    ddp = make_run(tmp_path, "mlx", 2)
    same = make_run(tmp_path, "mlx", 2, config={"strategy": "fsdp"}, name="mlx-fsdp-n2")
    (pair,) = judged(ddp, same)["strategy"]
    assert (pair["a"], pair["b"], pair["verdict"]) == ("mlx fsdp x2", "mlx x2", "pass")
    off = make_run(tmp_path, "mlx", 2, scaled(1.0 + 1e-4), config={"strategy": "fsdp"}, name="off")
    (pair,) = judged(ddp, off)["strategy"]
    assert pair["verdict"] == "fail" and pair["checks"]["per_step"]["max_abs_diff"] > Tolerances().dp_atol


def test_tp_is_judged_against_one_rank_ddp_because_its_ranks_are_one_replica(tmp_path):
    runs = [make_run(tmp_path, "torch", 1), make_run(tmp_path, "torch", 2),
            make_run(tmp_path, "torch", 2, config={"strategy": "tp"}, name="torch-tp-n2")]
    result = judged(*runs)
    assert [(p["a"], p["b"]) for p in result["strategy"]] == [("torch tp x2", "torch x1")]
    assert [(p["a"], p["b"]) for p in result["dp_invariance"]] == [("torch x2", "torch x1")]


def test_pp_is_judged_against_one_rank_ddp_and_mlx_pp_against_torch_pp(tmp_path):
    runs = [make_run(tmp_path, "mlx", 1), make_run(tmp_path, "torch", 1),
            make_run(tmp_path, "mlx", 2, config={"strategy": "pp"}, name="mlx-pp-n2"),
            make_run(tmp_path, "torch", 2, config={"strategy": "pp"}, name="torch-pp-n2")]
    result = judged(*runs)
    assert sorted((p["a"], p["b"]) for p in result["strategy"]) == [("mlx pp x2", "mlx x1"), ("torch pp x2", "torch x1")]
    assert ("mlx pp x2", "torch pp x2") in [(p["a"], p["b"]) for p in result["cross_framework"]]


def test_bf16_pairs_are_judged_relative_to_the_loss_where_fp32_tolerances_would_fail(tmp_path):
    bf16 = {"dtype": "bfloat16"}
    a = make_run(tmp_path, "mlx", 1, config=bf16, name="mlx-bf16-n1")
    gap = Tolerances().bf16_loss_rtol / 2  # within bf16's tolerance, 10x fp32's on a loss of ~3-7
    b = make_run(tmp_path, "torch", 1, scaled(1 + gap), config=bf16, name="torch-bf16-n1")
    (pair,) = judged(a, b)["cross_framework"]
    step = pair["checks"]["per_step"]
    assert pair["verdict"] == "pass" and step["relative"] and step["max_rel_diff"] == pytest.approx(gap, rel=0.01)
    fp32 = judged(make_run(tmp_path, "mlx", 1), make_run(tmp_path, "torch", 1, scaled(1 + gap)))
    assert fp32["cross_framework"][0]["verdict"] == "fail"  # the same gap in fp32 is a bug
    far = make_run(tmp_path, "torch", 1, scaled(1.2), config=bf16, name="far")
    assert judged(a, far)["cross_framework"][0]["verdict"] == "fail"


def test_bf16_is_compared_with_its_own_fp32_run_by_trend_only(tmp_path):
    fp32 = make_run(tmp_path, "mlx", 1)
    gap = Tolerances().precision_curve_rtol / 2
    bf16 = make_run(tmp_path, "mlx", 1, scaled(1 + gap), config={"dtype": "bfloat16"}, name="mlx-bf16-n1")
    (pair,) = judged(fp32, bf16)["precision"]
    assert (pair["a"], pair["b"], pair["verdict"]) == ("mlx bf16 x1", "mlx x1", "pass")
    assert set(pair["checks"]) == {"curve", "eval"}  # no per-step check: the two part ways at step 1
    drifted = make_run(tmp_path, "mlx", 1, scaled(1.3, from_step=10), config={"dtype": "bfloat16"}, name="d")
    assert judged(fp32, drifted)["precision"][0]["verdict"] == "fail"


@pytest.mark.usefixtures("no_figures")
def test_the_report_states_strategy_memory_and_bf16_tolerances(tmp_path):
    runs = [make_run(tmp_path, "mlx", 2), make_run(tmp_path, "mlx", 2, config={"strategy": "fsdp"}, name="f"),
            make_run(tmp_path, "mlx", 2, config={"dtype": "bfloat16"}, name="b")]
    import json
    for run, params in zip(runs[:2], (100e6, 50e6)):  # as runner.py writes state_bytes per rank
        summary = json.loads((run / "summary.json").read_text())
        summary["state_bytes"] = {"params": [params] * 2, "grads": [params] * 2, "optimizer": [2 * params] * 2}
        (run / "summary.json").write_text(json.dumps(summary))
    summary = write_report(runs, tmp_path / "report", Tolerances(), {"peaks": {}})
    rows = {(r["kind"], r["pair"]): r["verdict"] for r in summary["verdicts"]["pairs"]}
    assert rows[("strategy vs ddp", "mlx fsdp x2 vs mlx x2")] == "pass"
    assert rows[("bf16 vs fp32", "mlx bf16 x2 vs mlx x2")] == "pass"
    lines = "\n".join(summary["verdicts"]["lines"])
    assert "Memory, mlx fsdp x2: parameters + gradients + optimizer state 200.0 MB per rank, 0.50x" in lines
    md = (tmp_path / "report" / "report.md").read_text()
    assert "## Memory per rank" in md and "bfloat16 pairs are judged relative to the loss" in md
    # What the bf16 verdict cannot catch is said plainly, with the figures (docs/precision.md).
    assert "What a bf16 pass can and cannot tell" in md and "cannot tell a subtle policy mismatch from rounding" in md
    assert "2-5e-4 relative per step" in md and "tests/unit/test_bf16.py" in md


def test_a_matrix_leaves_out_sharded_runs_on_one_rank_and_names_every_run(tmp_path):
    base = RunConfig(nproc=2)
    configs, left_out = expand_matrix(base, ["mlx", "torch"], ["ddp", "fsdp"], ["float32"], [1, 2], tmp_path)
    assert [label for label, _ in configs] == ["mlx x1", "mlx x2", "torch x1", "torch x2", "mlx fsdp x2",
                                               "torch fsdp x2"]
    assert {d.name for _, d in configs} == {"mlx-n1", "mlx-n2", "torch-n1", "torch-n2", "mlx-fsdp-n2",
                                            "torch-fsdp-n2"}
    assert len(left_out) == 2 and all("needs 2 or more ranks" in reason for reason in left_out)
    with pytest.raises(UserError, match="nothing to run"):
        expand_matrix(base, ["mlx"], ["fsdp"], ["float32"], [1], tmp_path)


def test_a_matrix_without_ddp_still_runs_the_ddp_reference_its_1_asks_for(tmp_path):
    """`--strategies pp --nproc 1,2`: ddp x1 first (what pp x2 is judged against), not ddp x2; without the 1,
    no reference; and a reference with nothing to judge is still nothing to run."""
    base = RunConfig(nproc=2)
    configs, left_out = expand_matrix(base, ["mlx", "torch"], ["pp"], ["float32"], [1, 2], tmp_path)
    assert [label for label, _ in configs] == ["mlx x1", "torch x1", "mlx pp x2", "torch pp x2"]
    assert [cfg.strategy for cfg in configs.values()] == ["ddp", "ddp", "pp", "pp"]
    assert "mlx x1, torch x1 added: the reference the other runs are judged against" in left_out
    configs, left_out = expand_matrix(base, ["mlx"], ["pp"], ["float32"], [2], tmp_path)
    assert [label for label, _ in configs] == ["mlx pp x2"] and not any("added" in r for r in left_out)
    with pytest.raises(UserError, match="nothing to run"):
        expand_matrix(base, ["mlx", "torch"], ["tp", "fsdp"], ["float32"], [1], tmp_path)


def test_compare_refuses_a_taken_run_directory_before_anything_trains(tmp_path, cache_dir):
    out = tmp_path / "cmp"
    (out / "torch-n2").mkdir(parents=True)
    (out / "torch-n2" / "metrics.jsonl").write_text("")  # a run a user made there earlier
    proc = dpcompare_here("compare", *FAST, "--steps", 2, "--nproc", "1,2", "--out", out, cache_dir=cache_dir)
    assert proc.returncode == 2 and "torch-n2 already holds a run" in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1
    assert not (out / "mlx-n1").exists(), "nothing may train before every directory is checked"
