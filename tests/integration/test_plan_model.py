"""`dpcompare plan --model` (issue 56) with the real block probe, calibrated on the shared `matrix`'s torch x1 run
(read only, nothing trained here). The probe's accuracy is benchmarks/bench_plan_model.py's figure on a quiet
machine; this checks the mechanism: a row per layout, memory parts that add up, the fit column following
--device-memory-gb, and plan.json naming the model. A short sequence and batch keep the probe to seconds."""
import json

from helpers import dpcompare

from common.model.spec import PRESETS, ModelSpec

DEVICE_GB = 0.8  # between fsdp x2's predicted peak and ddp's on the reference machine; the test holds at any value


def test_plan_model_probes_small_on_a_tiny_run_and_judges_each_layout_against_the_memory_given(matrix, tmp_path):
    out = tmp_path / "plan"
    proc = dpcompare("plan", "--from", matrix.run("torch", 1), "--model", "small", "--seq-len", 32,
                     "--global-batch-size", 2, "--nproc", 2, "--strategies", "ddp,fsdp", "--device-memory-gb",
                     DEVICE_GB, "--out", out, cache_dir=tmp_path)
    plan = json.loads((out / "plan.json").read_text())
    assert plan["model"]["name"] == "small" and ModelSpec.from_dict(plan["model"]["spec"]) == PRESETS["small"]
    assert (plan["model"]["seq_len"], plan["model"]["global_batch_size"]) == (32, 2)
    probe = plan["frameworks"]["torch"]["probe"]
    assert probe["model"]["framework"] == "torch" and probe["request"]["spec"]["dim"] == PRESETS["small"].dim
    # the head's resident peak is measured (model_memory's head phase): its logits at least are resident at it
    request = probe["request"]
    assert probe["model"]["head_peak_bytes"] >= request["rows"] * request["seq_len"] * request["vocab_rows"] * 4
    rows = plan["predictions"]
    assert {(r["framework"], r["strategy"], r["world_size"]) for r in rows} == {
        ("torch", "ddp", 1), ("torch", "ddp", 2), ("torch", "fsdp", 2)}
    for r in rows:
        memory = r["memory_bytes"]
        assert abs(sum(v for k, v in memory.items() if k != "total") - memory["total"]) <= 1e-6 * memory["total"], r
        # a one-rank run's op profile after training holds a copy of the gradients: its row fits where that does too
        assert (r["op_profile_bytes"] > 0) is (r["world_size"] == 1), r
        assert r["fits"] is (memory["total"] + r["op_profile_bytes"] <= DEVICE_GB * 1e9), r
        assert r["memory_peak_at"] in ("head", "backward", "update"), r
        assert r["step_s"] > 0 and r["tokens_per_s"] > 0
        if not r["fits"]:  # a layout that does not fit is told the cheapest change, on its own line too
            assert r["to_fit"] and f"{r['strategy']} x{r['world_size']} does not fit: {r['to_fit']}" in proc.stdout
    assert "plan for small (4 layers" in proc.stdout and "fits" in proc.stdout
