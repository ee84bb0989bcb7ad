"""The parity judge: when MLX and torch curves agree, when they do not, and when they cannot be compared.

Run directories are synthetic but written with the real schema (run_config.json, metrics.jsonl,
summary.json as compare/launch/runner.py writes them: tests/unit/fake_runs.py), so the judge reads exactly
what a real run leaves.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from compare.report.parity import RunData, Tolerances, compare_pair, moving_average
from unit.fake_runs import STEPS, judged, make_run, reference_losses

def test_identical_curves_pass_every_check(tmp_path):
    evals = {20: 3.1, 40: 2.9}
    result = judged(make_run(tmp_path, "mlx", 1, evals=evals), make_run(tmp_path, "torch", 1, evals=evals))
    (pair,) = result["cross_framework"]
    assert pair["verdict"] == "pass" and result["overall"] == "pass" and result["all_pass"]
    assert pair["checks"]["per_step"]["max_abs_diff"] == 0.0
    assert pair["checks"]["per_step"]["steps_compared"] == 20
    assert pair["checks"]["curve"]["steps_compared"] == STEPS
    assert pair["checks"]["eval"]["steps_compared"] == 2 and pair["checks"]["eval"]["verdict"] == "pass"


def test_a_1e3_offset_fails_the_per_step_check_but_not_the_curve_check(tmp_path):
    shifted = [x + 1e-3 for x in reference_losses()]
    result = judged(make_run(tmp_path, "mlx", 1), make_run(tmp_path, "torch", 1, shifted))
    (pair,) = result["cross_framework"]
    assert pair["checks"]["per_step"]["verdict"] == "fail"
    assert abs(pair["checks"]["per_step"]["max_abs_diff"] - 1e-3) < 1e-9
    assert pair["checks"]["curve"]["verdict"] == "pass"  # 1e-3 on a loss of ~3 is far below 2 %
    assert pair["verdict"] == "fail" and result["overall"] == "fail" and not result["all_pass"]


def test_a_drift_after_the_first_steps_fails_the_curve_check(tmp_path):
    drifted = [x * (1.0 if s <= 20 else 1.1) for s, x in enumerate(reference_losses(), start=1)]
    (pair,) = judged(make_run(tmp_path, "mlx", 1), make_run(tmp_path, "torch", 1, drifted))["cross_framework"]
    assert pair["checks"]["per_step"]["verdict"] == "pass"
    assert pair["checks"]["curve"]["verdict"] == "fail" and pair["checks"]["curve"]["max_rel_diff"] > 0.05


def test_eval_losses_are_compared_at_common_steps(tmp_path):
    a = make_run(tmp_path, "mlx", 1, evals={20: 3.0, 40: 2.9})
    b = make_run(tmp_path, "torch", 1, evals={20: 3.0, 40: 3.2})
    (pair,) = judged(a, b)["cross_framework"]
    assert pair["checks"]["eval"]["verdict"] == "fail" and pair["checks"]["eval"]["at_step"] == 40


def test_pairs_are_made_per_world_size_and_dp_runs_are_checked_against_one_rank(tmp_path):
    dirs = [make_run(tmp_path, fw, n) for fw in ("mlx", "torch") for n in (1, 2)]
    result = judged(*dirs)
    assert [(p["a"], p["b"]) for p in result["cross_framework"]] == [("mlx x1", "torch x1"),
                                                                     ("mlx x2", "torch x2")]
    assert [(p["a"], p["b"]) for p in result["dp_invariance"]] == [("mlx x2", "mlx x1"), ("torch x2", "torch x1")]
    assert all(p["verdict"] == "pass" for p in result["dp_invariance"])


def test_dp_invariance_uses_its_own_tolerance(tmp_path):
    off = [x + 5e-4 for x in reference_losses()]
    result = judged(make_run(tmp_path, "mlx", 1), make_run(tmp_path, "mlx", 2, off),
                    tol=Tolerances(dp_atol=1e-3, loss_atol=1e-6))
    (pair,) = result["dp_invariance"]
    assert pair["verdict"] == "pass" and pair["checks"]["per_step"]["tolerance"] == 1e-3


def test_incomparable_configs_are_reported_as_such_not_as_failures(tmp_path):
    a = make_run(tmp_path, "mlx", 1, config={"seed": 0})
    b = make_run(tmp_path, "torch", 1, [x + 1.0 for x in reference_losses()], config={"seed": 1, "lr": 1e-3})
    result = judged(a, b)
    (pair,) = result["cross_framework"]
    assert pair["verdict"] == "not comparable" and not pair["comparable"]
    assert pair["differences"] == {"lr": [3e-4, 1e-3], "seed": [0, 1]}
    assert result["overall"] == "not comparable" and result["all_pass"]


def test_how_a_run_executes_does_not_make_it_incomparable(tmp_path):
    a = make_run(tmp_path, "mlx", 2, config={"threads_per_rank": 1, "all_reduce_size_mb": 8.0})
    b = make_run(tmp_path, "torch", 2, config={"threads_per_rank": 2, "out": "/elsewhere", "grad_accum": 2})
    (pair,) = judged(a, b)["cross_framework"]
    assert pair["comparable"] and pair["verdict"] == "pass"


def test_failed_and_unfinished_runs_are_listed_and_skipped(tmp_path):
    ok = [make_run(tmp_path, "mlx", 1), make_run(tmp_path, "torch", 1)]
    failed = make_run(tmp_path, "torch", 2, reference_losses()[:7], status="failed")
    unfinished = make_run(tmp_path, "mlx", 2, write_summary=False)
    empty = tmp_path / "never-started"
    empty.mkdir()
    result = judged(*ok, failed, unfinished, empty)
    skipped = {s["run_dir"]: s for s in result["skipped"]}
    assert set(skipped) == {str(failed), str(unfinished), str(empty)}
    assert "rank 1 died" in skipped[str(failed)]["reason"]
    assert "incomplete" in skipped[str(unfinished)]["reason"]
    assert result["dp_invariance"] == [] and len(result["cross_framework"]) == 1
    assert result["overall"] == "pass"


def test_the_judgement_is_json_serialisable(tmp_path):
    result = judged(make_run(tmp_path, "mlx", 1, evals={20: 3.0}), make_run(tmp_path, "torch", 1, evals={20: 3.0}),
                    make_run(tmp_path, "torch", 2, status="failed"))
    assert json.loads(json.dumps(result)) == result


def test_duplicate_framework_and_world_size_get_distinct_labels(tmp_path):
    runs = [make_run(tmp_path, "mlx", 2, name="ring", config={"backend": "ring"}),
            make_run(tmp_path, "mlx", 2, name="mpi", config={"backend": "mpi"})]
    labels = [r["label"] for r in judged(*runs)["runs"]]
    assert len(set(labels)) == 2


def test_moving_average_is_a_trailing_mean():
    assert np.allclose(moving_average(np.array([1.0, 3.0, 5.0, 7.0]), 2), [1.0, 2.0, 4.0, 6.0])


def in_memory_run(label: str, losses: list[float]) -> RunData:
    rows = [{"step": s, "loss": x} for s, x in enumerate(losses, start=1)]
    return RunData(Path(label), {"framework": label, "world_size": 1, "status": "ok", "config": {"seed": 0}},
                   rows, [], {}, label=label)


@settings(max_examples=40, deadline=None)
@given(offset=st.floats(min_value=0.0, max_value=1e-3), at=st.integers(min_value=1, max_value=STEPS))
def test_the_per_step_check_fails_exactly_when_one_step_exceeds_the_tolerance(offset, at):
    base = reference_losses()
    other = [x + (offset if s == at else 0.0) for s, x in enumerate(base, start=1)]
    tol = Tolerances()
    check = compare_pair(in_memory_run("mlx", base), in_memory_run("torch", other), "cross_framework",
                         tol)["checks"]["per_step"]
    exceeded = at <= tol.parity_steps and abs((base[at - 1] + offset) - base[at - 1]) > tol.loss_atol
    assert (check["verdict"] == "fail") == exceeded
