"""Where the time goes: every run kind gets a per-phase breakdown whose phases add up to its measured step
time, and the report shows it. (common/train/breakdown.py says how each phase is measured.)"""
import json
import re

from common.train.opclasses import OP_CLASSES
from helpers import summary

PHASES = ("data", "forward", "backward", "communication", "optimizer", "other")


def test_every_run_has_a_breakdown_that_adds_up_to_its_step_time_and_the_report_shows_it(matrix):
    # The matrix's shape (steps of ~50-200 ms on 2 cores, 3 profile rounds) keeps timer noise small next to a
    # step on a quiet machine; on a busy one the split can miss, and then the record and the report must say so.
    # Whether it holds its 15 % on a quiet machine is a benchmark's figure (benchmarks/bench_gap.py's phases).
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
        assert b["profile_steps"] == len(b["rounds"]) == 3
        if not b["within_tolerance"]:
            # MLX's rounds at two ranks on 2 cores swung from 65 to 253 ms within one run of this matrix, and
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


def test_a_one_rank_run_times_its_op_classes_which_add_up_to_its_step_and_the_verdict_names_one(matrix):
    # The same matrix runs (no run of its own): each 1-rank run profiles the model's op classes after training
    # (common/train/opprofile.py), at the matrix's shapes; 2-rank runs do not.
    out = matrix.out
    md = (out / "report.md").read_text()
    for name in ("mlx-n1", "torch-n1"):
        o = summary(out / name)["op_profile"]
        print(f"{name}: classes {o['class_sum_s'] * 1e3:.1f} ms of a {o['reference_step_s'] * 1e3:.1f} ms step "
              f"({100 * o['outside_share']:+.0f}% outside), profile {o['wall_s']:.2f} s: "
              + ", ".join(f"{c} {v['s'] * 1e3:.1f}" for c, v in o["classes"].items()))
        assert list(o["classes"]) == list(OP_CLASSES) and all(v["s"] > 0 for v in o["classes"].values()), o
        assert o["shapes"] == {"micro_batch": 32, "seq_len": 128, "grad_accum": 1, "dtype": "float32"}
        # The classes add up to the step: the record holds itself to the 15 % measured on the demo
        # (docs/profiling.md, "The op classes") and says when it misses, and so does the report. On a busy
        # machine one sitting can miss either way (torch x1: -27 % and +16 % in 2 of 24 CI logs on the Zen 4),
        # so the test holds the record to its own verdict; the figure is benchmarks/bench_ops.py's.
        assert o["class_sum_s"] > 0 and o["reference_step_s"] > 0 and len(o["rounds"]) == o["reps"], o
        assert o["tolerance"] == 0.15 and o["within_tolerance"] == (abs(o["outside_share"]) <= o["tolerance"]), o
        if not o["within_tolerance"]:
            assert f"{name.replace('-n', ' x')}: the classes add up to" in md and "measure again on a quieter" in md
        assert o["reps"] >= 3 and o["memory_bandwidth_Bps"] > 0
    for name in ("mlx-n2", "torch-n2"):
        assert summary(out / name).get("op_profile") is None
    assert "## Op classes" in md and "| op class | lower bound ms | mlx x1 ms | torch x1 ms |" in md, md
    at_one = next(s for s in matrix.summary["speed"] if s["world_size"] == 1 and s["kind"] == "framework")
    assert at_one["op_class"]["class"] in OP_CLASSES and at_one["op_class_gap"] in md
