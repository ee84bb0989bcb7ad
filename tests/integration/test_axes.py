"""The strategy axis in a real report: ddp, fsdp and tp of both frameworks in one report (of the session's
shared 2-rank runs). The dtype axis, float32 beside bfloat16 in one compare whose failed float32 verdict
brings a diagnosis, is tested in test_bf16.py on the compare its runs come from. The judging itself is
tested on synthetic runs in tests/unit/test_axes.py."""
from __future__ import annotations

import pytest

from helpers import dpcompare


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
    rows = {(r["kind"], r["pair"]): r["verdict"] for r in summary["verdicts"]["pairs"]}
    assert rows[("strategy vs ddp", "mlx tp x2 vs mlx x2")] == "pass"
    md = (out / "report.md").read_text()
    # the pair is one row of the verdict table (compare/report/verdict_table.py), which the report shows
    row = next(line for line in md.splitlines() if "mlx tp x2 vs mlx x2" in line and line.startswith("|"))
    assert "## Memory per rank" in md and "| pass | strategy vs ddp |" in row
