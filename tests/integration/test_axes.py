"""The strategy and dtype axes in real compares: float32 beside bfloat16 in one report (a failed float32
verdict brings a diagnosis), and ddp, fsdp and tp of both frameworks in one report (of the session's shared
2-rank runs). The judging itself is tested on synthetic runs in tests/unit/test_axes.py."""
from __future__ import annotations

import pytest

from helpers import FAST, dpcompare


@pytest.mark.slow
def test_float32_and_bfloat16_share_a_report_and_a_failed_float32_verdict_brings_a_diagnosis(cache_dir, tmp_path):
    """One compare for both (each costs four runs): a per-step tolerance no float32 pair can meet fails the
    float32 cross-framework verdict, so compare diagnoses that pair; bf16 pairs are judged relative to the
    loss, which --loss-atol does not touch, so they still pass."""
    import json
    out = tmp_path / "cmp"
    proc = dpcompare("compare", *FAST, "--steps", 3, "--nproc", "1", "--dtypes", "float32,bfloat16",
                     "--loss-atol", "1e-15", "--out", out, cache_dir=cache_dir)
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
    assert any(line.startswith("Diagnosis, mlx x1 vs torch x1:") for line in summary["verdicts"]["lines"])
    assert "Diagnosis" in proc.stdout
    samples = summary["samples"]["by_run"]
    assert {"mlx x1", "torch x1"} <= set(samples) and all(s.get("tokens") for s in samples.values())
    assert summary["samples"]["fp32_identical"] is True, samples  # greedy tokens from fp32-equal weights
    assert "## Greedy continuations" in (out / "report.md").read_text()


@pytest.mark.slow
def test_ddp_fsdp_and_tp_of_both_frameworks_share_one_report(uninterrupted, cache_dir, tmp_path):
    """The report of the six 2-rank runs the fsdp and tp tests already train (integration/conftest.py):
    strategy pairs, cross-framework pairs, state and time breakdown for every strategy."""
    import json
    out = tmp_path / "rep"
    dirs = [uninterrupted(fw, s, 2) for fw in ("mlx", "torch") for s in ("ddp", "fsdp", "tp")]
    dpcompare("report", *dirs, "--out", out, cache_dir=cache_dir)
    summary = json.loads((out / "summary.json").read_text())
    labels = {r["label"] for r in summary["runs"]}
    assert labels == {f"{fw} {s}x2".replace("ddp ", "") for fw in ("mlx", "torch") for s in ("ddp ", "fsdp ", "tp ")}
    pairs = {(p["a"], p["b"]): p["verdict"] for p in summary["parity"]["strategy"]}
    # tp's reference is a 1-rank ddp run when there is one; here only N=2 ran, so ddp x2 (the same batch).
    assert pairs == {("mlx fsdp x2", "mlx x2"): "pass", ("mlx tp x2", "mlx x2"): "pass",
                     ("torch fsdp x2", "torch x2"): "pass", ("torch tp x2", "torch x2"): "pass"}
    assert len(summary["parity"]["cross_framework"]) == 3 and summary["verdicts"]["all_pass"]
    for row in summary["runs"]:  # every strategy reports its state and its time breakdown
        assert row["breakdown"]["forward"] > 0 and all(row["state_mb"][k] for k in ("params", "grads", "optimizer"))
    md = (out / "report.md").read_text()
    assert "## Memory per rank" in md and "**Strategy, tp:** mlx tp x2 matches mlx x2" in md
