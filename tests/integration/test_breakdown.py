"""Where the time goes: every run kind gets a per-phase breakdown whose phases add up to its measured step
time, and the report shows it. (common/breakdown.py says how each phase is measured.)"""
import json

from helpers import summary

PHASES = ("data", "forward", "backward", "communication", "optimizer", "other")


def test_every_run_has_a_breakdown_that_adds_up_to_its_step_time_and_the_report_shows_it(matrix):
    # The matrix's shape (steps of ~50-200 ms on 2 cores, 8 profile steps of each kind) keeps timer noise
    # (and gloo's jitter between synced and unsynced steps) small next to a step.
    out = matrix.out
    for name in ("mlx-n1", "mlx-n2", "torch-n1", "torch-n2"):
        b = summary(out / name)["breakdown"]
        assert set(PHASES) <= set(b) and all(b[p] >= 0 for p in PHASES), b
        assert b["forward"] > 0 and b["backward"] > 0 and b["optimizer"] > 0
        steps = sum(b[p] for p in PHASES if p != "data")  # data assembly is outside the step timer
        print(f"{name}: step {b['step_s'] * 1e3:.1f} ms (alongside: {b['reference_step_s'] * 1e3:.1f}), phases "
              f"{steps * 1e3:.1f} ms " + ", ".join(f"{p} {b[p] * 1e3:.1f}" for p in PHASES))
        # Against uninstrumented steps taken in alternation with the instrumented ones (same load, same
        # caches); the run's own median is reported beside them.
        assert abs(steps - b["reference_step_s"]) <= 0.15 * b["reference_step_s"], (name, b)
        if name.endswith("n1"):
            assert b["communication"] == 0
        else:
            assert b["synced_step_s"] > 0 and b["unsynced_step_s"] > 0
    report = json.loads((out / "summary.json").read_text())
    assert "breakdown" in report["plots"] and (out / report["plots"]["breakdown"]).exists()
    assert "Where the time goes" in (out / "report.md").read_text()
    assert any("the phase that differs most is" in line for line in report["verdicts"]["lines"])
