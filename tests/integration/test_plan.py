"""The cost model on a real comparison: the shared `matrix` (read only, nothing trained here) carries a
`prediction` in its N=2 summaries and the report, and `dpcompare plan --from` calibrates on one of its runs."""
import json

from helpers import dpcompare

# Measured on the reference machine (2 cores, tests/costmodel_fixtures.py): N=2 predicted from N=1 over
# assumed loopback figures came out 15 % (MLX) and 9 % (torch) low on a quiet machine; with other people's
# jobs on the 2 cores (load average 3-5) MLX's N=2 step measured 150 ms against 66 ms predicted (0.44x).
# So this checks the prediction's units and size (a slip of seconds for ms, or per rank for per job, is
# far outside), not its accuracy: that is benchmarks/bench_plan.py's, on a quiet machine.
WITHIN = (0.2, 5.0)


def test_compare_predicts_every_two_rank_run_and_plan_calibrates_on_one(matrix, tmp_path):
    for framework in ("mlx", "torch"):
        s = json.loads((matrix.run(framework, 2) / "summary.json").read_text())
        p = s["prediction"]
        assert p["from"] == f"{framework}-n1"
        assert s["link"]["allreduce"]["bandwidth_Bps"] > 0  # the matrix's --link-probe, after FAST's --no-link-probe
        assert WITHIN[0] < p["step_s"] / s["step_time_s"] < WITHIN[1], p
        assert abs(p["tokens_per_s"] * p["step_s"] / s["tokens_per_step"] - 1) < 1e-9
        assert "prediction" not in json.loads((matrix.run(framework, 1) / "summary.json").read_text())
    assert "## Predicted and measured" in (matrix.out / "report.md").read_text()

    out = tmp_path / "plan"
    proc = dpcompare("plan", "--from", matrix.run("torch", 1), "--nproc", "2,4", "--strategies", "ddp,fsdp",
                     "--link-gbps", "1", "--latency-us", "100", "--out", out, cache_dir=tmp_path)
    assert "bottleneck is" in proc.stdout
    plan = json.loads((out / "plan.json").read_text())
    assert (out / "plan.png").exists()
    one = next(p for p in plan["predictions"] if p["world_size"] == 1)
    measured = json.loads((matrix.run("torch", 1) / "summary.json").read_text())["breakdown"]["step_s"]
    assert abs(one["step_s"] / measured - 1) < 1e-9  # the calibration run, reproduced
    assert {(m["strategy"], m["world_size"]) for m in plan["measured"]} == {("ddp", 1), ("ddp", 2)}
