"""--dtype bfloat16 is real mixed precision in both frameworks, on the CPU too: bf16 compute from float32
master weights, within the documented tolerances of float32 (common/model/precision.py, docs/precision.md)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from common.model.precision import DEFAULT_TOLERANCES
from compare.report.parity import moving_average
from helpers import FAST, dpcompare, losses, summary
from integration.runs import resumed_from, rewound

BF16 = DEFAULT_TOLERANCES["bfloat16"]
FRAMEWORKS = ["mlx", "torch"]


# ---- slow: the real CLI ------------------------------------------------------------------------------

# 12 steps (20 before): the tolerances' windows fit, and MLX's bf16 on a CPU (its own kernel, not BLAS) is the
# slowest training of the suite.
STEPS = ("--steps", 12, "--lr-decay-steps", 12, "--lr", "3e-3", "--eval-every", 12)
HALF = 6
HALFWAY = ("--checkpoint-every", HALF)  # the compare's bf16 runs keep step 6: the resume test's first half


def rel(a, b) -> np.ndarray:
    return np.abs(np.subtract(a, b)) / np.abs(b)


def eval_loss(run_dir) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["eval_loss"] for r in rows if "eval_loss" in r][-1]


@pytest.fixture(scope="module")
def runs(cache_dir, tmp_path_factory):
    """fp32 and bf16 at N=1 of both frameworks in one compare (which the float32/bfloat16 report test below
    reads; its bf16 runs, rewound to their step-10 checkpoint, are the resume test's first half), bf16 at N=2
    of both as runs; each directory once for the module. The compare's per-step tolerance (--loss-atol 1e-15)
    is one no float32 pair can meet; it judges, and changes no run."""
    root = tmp_path_factory.mktemp("bf16")
    cmp = root / "cmp"
    proc = dpcompare("compare", *FAST, *STEPS, *HALFWAY, "--frameworks", ",".join(FRAMEWORKS), "--nproc", 1,
                     "--dtypes", "float32,bfloat16", "--loss-atol", "1e-15", "--out", cmp, cache_dir=cache_dir)
    out = {"compare": (cmp, proc.stdout)}
    for framework in FRAMEWORKS:
        out[framework, "float32", 1], out[framework, "bfloat16", 1] = cmp / f"{framework}-n1", cmp / f"{framework}-bf16-n1"
        run_dir = out[framework, "bfloat16", 2] = root / f"{framework}-bfloat16-2"
        dpcompare("run", *FAST, *STEPS, "--framework", framework, "--dtype", "bfloat16", "--nproc", 2,
                  "--out", run_dir, cache_dir=cache_dir)
    return out


@pytest.mark.slow
def test_float32_and_bfloat16_share_a_report_and_a_failed_float32_verdict_brings_a_diagnosis(runs):
    """(Moved from test_axes.py, to read this module's compare.) One compare for both: a per-step tolerance no
    float32 pair can meet fails the float32 cross-framework verdict, so compare diagnoses that pair; bf16
    pairs are judged relative to the loss, which --loss-atol does not touch, so they still pass."""
    out, stdout = runs["compare"]
    summary = json.loads((out / "summary.json").read_text())
    assert {r["label"] for r in summary["runs"]} == {"mlx x1", "torch x1", "mlx bf16 x1", "torch bf16 x1"}
    cross = {p["a"]: p for p in summary["parity"]["cross_framework"]}
    assert cross["mlx bf16 x1"]["checks"]["per_step"]["relative"] and cross["mlx bf16 x1"]["verdict"] == "pass"
    assert {(p["a"], p["b"]) for p in summary["parity"]["precision"]} == {("mlx bf16 x1", "mlx x1"),
                                                                          ("torch bf16 x1", "torch x1")}
    assert all(p["verdict"] == "pass" for p in summary["parity"]["precision"])
    bf16 = next(r for r in summary["runs"] if r["label"] == "torch bf16 x1")
    assert bf16["precision"]["compute_dtype"] == "bfloat16" and bf16["final_loss"] != next(
        r for r in summary["runs"] if r["label"] == "torch x1")["final_loss"]  # bf16 really computed

    pair = cross["mlx x1"]
    assert pair["verdict"] == "fail" and pair["diagnosis"]["finding"].startswith("diagnosis (step 1")
    assert "diagnosis" not in cross["mlx bf16 x1"]  # only failed pairs are diagnosed
    assert (out / "diagnosis").is_dir()
    assert any(line.startswith("Diagnosis, mlx x1 vs torch x1:") for line in summary["verdicts"]["failures"])
    assert "Diagnosis" in stdout
    samples = summary["samples"]["by_run"]
    assert {"mlx x1", "torch x1"} <= set(samples) and all(s.get("tokens") for s in samples.values())
    assert summary["samples"]["fp32_identical"] is True, samples  # greedy tokens from fp32-equal weights
    assert "## Greedy continuations" in (out / "report.md").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_bf16_runs_differ_from_fp32_and_stay_within_the_documented_tolerance(framework, runs):
    fp32, bf16 = runs[framework, "float32", 1], runs[framework, "bfloat16", 1]
    s = summary(bf16)
    assert s["dtype"] == "bfloat16" and s["precision"]["compute_dtype"] == "bfloat16"
    assert s["precision"]["master_dtype"] == s["precision"]["reduce_dtype"] == "float32"
    a, b = losses(bf16), losses(fp32)
    assert len(a) == 12 and np.abs(np.subtract(a, b)).max() > 1e-6, "bfloat16 computed in float32"
    w = BF16["curve_window"]
    assert rel(moving_average(np.array(a), w), moving_average(np.array(b), w)).max() <= BF16["vs_fp32_curve_rtol"]
    assert rel(eval_loss(bf16), eval_loss(fp32)) <= BF16["vs_fp32_eval_rtol"]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_mlx_bf16_matches_torch_bf16(nproc, runs):
    mlx, torch_ = runs["mlx", "bfloat16", nproc], runs["torch", "bfloat16", nproc]
    a, b = np.array(losses(mlx)), np.array(losses(torch_))
    k, w = BF16["parity_steps"], BF16["curve_window"]
    assert rel(a[:k], b[:k]).max() <= BF16["loss_rtol"]
    assert rel(moving_average(a, w), moving_average(b, w)).max() <= BF16["curve_rtol"]
    assert rel(eval_loss(mlx), eval_loss(torch_)) <= BF16["eval_rtol"]


@pytest.mark.slow
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_dp_invariance_in_bf16_two_ranks_match_one_within_the_bf16_tolerance(framework, runs):
    one, two = losses(runs[framework, "bfloat16", 1]), losses(runs[framework, "bfloat16", 2])
    assert rel(two, one).max() <= BF16["dp_rtol"]


@pytest.mark.slow
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_bf16_run_resumes_exactly_from_its_float32_checkpoint(framework, runs, cache_dir, tmp_path):
    # The compare's bf16 run, as if stopped at step 6 (its first 6 steps: integration/runs.py's rewound),
    # resumed in a new process to step 12, must give that uninterrupted run's losses.
    straight = runs[framework, "bfloat16", 1]
    resumed = rewound(straight, tmp_path / "resumed", step=HALF)
    saved = load_file(resumed / "checkpoints" / f"step_{HALF:06d}" / "model.safetensors")
    assert {v.dtype for v in saved.values()} == {np.dtype(np.float32)}
    dpcompare("run", *FAST, *STEPS, *HALFWAY, "--framework", framework, "--dtype", "bfloat16", "--resume",
              "--out", resumed, cache_dir=cache_dir)
    assert resumed_from(resumed) == HALF and summary(resumed)["dtype"] == "bfloat16"  # resumed, not retrained
    np.testing.assert_allclose(losses(resumed), losses(straight), rtol=0, atol=1e-6)
