"""Where the time goes: every run kind gets a per-phase breakdown whose phases add up to its measured step
time, and the report shows it. (common/train/breakdown.py says how each phase is measured.)"""
import json
import re

from helpers import summary

PHASES = ("data", "forward", "backward", "communication", "optimizer", "other")


def test_every_run_has_a_breakdown_that_adds_up_to_its_step_time_and_the_report_shows_it(matrix):
    # The matrix's shape (steps of ~50-200 ms on 2 cores, 8 profile rounds) keeps timer noise
    # (and gloo's jitter between synced and unsynced steps) small next to a step.
    out = matrix.out
    md = (out / "report.md").read_text()
    for name in ("mlx-n1", "mlx-n2", "torch-n1", "torch-n2"):
        b = summary(out / name)["breakdown"]
        assert set(PHASES) <= set(b) and all(b[p] >= 0 for p in PHASES), b
        assert b["forward"] > 0 and b["backward"] > 0 and b["optimizer"] > 0
        steps = sum(b[p] for p in PHASES if p != "data")  # data assembly is outside the step timer
        print(f"{name}: step {b['step_s'] * 1e3:.1f} ms (alongside: {b['reference_step_s'] * 1e3:.1f}), phases "
              f"{steps * 1e3:.1f} ms " + ", ".join(f"{p} {b[p] * 1e3:.1f}" for p in PHASES))
        # Against uninstrumented steps taken in alternation with the instrumented ones (same load, same
        # caches); the run's own median is reported beside them. The flag says what the figures say.
        miss = abs(steps - b["reference_step_s"]) / b["reference_step_s"]
        assert b["within_tolerance"] is (miss <= 0.15) and b["tolerance"] == 0.15, (name, b)
        assert b["profile_steps"] == len(b["rounds"]) == 8
        if name.endswith("n1"):
            # One rank alone on the machine (tests/conftest.py trains the matrix before the xdist workers
            # start): the estimator must hold its tolerance.
            assert b["within_tolerance"], (name, b)
        elif not b["within_tolerance"]:
            # Two ranks on 2 cores: MLX's rounds swung from 65 to 253 ms within one run of this matrix, and
            # 8 rounds missed by 16 % (docs/profiling.md): the report must say the split is unreliable.
            assert f"{name.replace('-n', ' x')}: its phases add up to" in md, md
        for p in ("forward", "backward", "communication", "optimizer", "other", "reference_step_s"):
            lo, hi = b["spread"][p]  # p10-p90 over the rounds, around the median
            assert lo <= b[p] <= hi, (name, p, b)
        if name.endswith("n1"):
            assert b["communication"] == 0
        else:
            assert b["synced_step_s"] > 0 and b["unsynced_step_s"] > 0
    report = json.loads((out / "summary.json").read_text())
    assert "breakdown" in report["plots"] and (out / report["plots"]["breakdown"]).exists()
    assert "Where the time goes" in md and "10th to 90th percentile of the rounds" in md
    assert re.search(r"\| mlx x2 \| [\d.,]+ \| [\d.,]+ \[[\d.,]+–[\d.,]+\]", md), md
    assert report["speed"] and all(s["phase"]["phase"] in PHASES for s in report["speed"])  # speed table
