"""`dpcompare plan --model` (issue 56): the probe's figures composed into a step, the memory of a model nobody
trained, the fit column and the cheapest change, and the one-line refusals. The probe itself is a subprocess of a
framework (tests/integration/test_plan_model.py runs it); here a fake stands in, its figures linear in the FLOPs."""
import json
from dataclasses import replace

import pytest
from costmodel_fixtures import summary, write_run

from common.costmodel.model_memory import model_memory
from common.costmodel.probed import Phases, phases, request_for, transfer
from common.costmodel.workload import Workload
from common.model.hfconfig import to_hf_config
from common.model.lora import Adapters, FullModel
from common.model.spec import PRESETS
from common.parallel import layout
from compare.cli import main


def fake_probe(framework, req, environment):
    """Seconds proportional to each piece's FLOPs at 10 GFLOP/s: what the composition must carry through."""
    from common.costmodel.probed import block_flops_per_token

    tokens = req.rows * req.seq_len
    block = block_flops_per_token(req.spec, req.seq_len) * tokens / 1e10
    head = 6 * req.vocab_rows * req.spec.dim * tokens / 1e10
    return {"block_forward_s": block / 3, "block_step_s": block, "head_forward_s": head / 3, "head_step_s": head,
            "optimizer_s": 1e-9 * req.optimizer_elements, "optimizer_elements": req.optimizer_elements}


@pytest.fixture
def runs(tmp_path, monkeypatch):
    import compare.plan.model_plan as model_plan

    monkeypatch.setattr(model_plan, "run_probe", fake_probe)
    monkeypatch.setattr(model_plan, "run_environment", lambda run_dir, summary: {})
    write_run(tmp_path / "torch-n1", summary("torch", 1))
    write_run(tmp_path / "mlx-n1", summary("mlx", 1))
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(to_hf_config(PRESETS["base"])))
    return tmp_path


def test_phases_scale_the_probed_rows_to_the_global_batch_and_the_head_to_the_vocabulary():
    w = Workload(PRESETS["small"], 128, 8, framework="torch")
    req = request_for(w, FullModel(), (0, 64))
    figures = {"block_forward_s": 1.0, "block_step_s": 3.0, "head_forward_s": 0.5, "head_step_s": 1.5,
               "optimizer_s": 2.0, "optimizer_elements": 1000}
    p = phases(figures, req, w)
    scale, vocab = 8 / req.rows, PRESETS["small"].vocab_size / req.vocab_rows
    assert p.forward_s == pytest.approx(scale * (4 * 1.0 + vocab * 0.5))
    assert p.compute_s == pytest.approx(scale * (4 * 3.0 + vocab * 1.5))
    assert p.optimizer_s == pytest.approx(2.0 / 1000 * FullModel().trained_parameters(PRESETS["small"]))


def test_a_quantized_bases_per_call_cost_is_paid_once_per_micro_step_on_every_rank_not_per_row():
    """Timed at 1 and 2 rows: what the second row added grows with the rows, the rest is each call's (the base's
    dequantization): paid grad_accum times a step by every rank, whatever N splits."""
    from common.costmodel.probed import split_per_call

    w = Workload(PRESETS["small"], 128, 8, grad_accum=2, framework="torch")
    req = request_for(w, Adapters(8, 16.0), (4, 64))
    once = {"block_forward_s": 1.0, "block_step_s": 3.0, "head_forward_s": 0.5, "head_step_s": 1.5,
            "optimizer_s": 2.0, "optimizer_elements": 1000}
    twice = {**once, "block_forward_s": 1.25, "block_step_s": 3.5, "head_forward_s": 0.75, "head_step_s": 1.0}
    split = split_per_call(once, twice, 1)
    assert split["block_forward_s"] == 0.25 and split["block_forward_fixed_s"] == 0.75
    assert split["block_step_s"] == 0.5 and split["block_step_fixed_s"] == 2.5
    assert split["head_step_s"] == 0.0 and split["head_step_fixed_s"] == 1.5   # a noisy pair: none grows
    p = phases(split, req.__class__(**{**vars(req), "rows": 1}), w)
    vocab = PRESETS["small"].vocab_size / req.vocab_rows
    assert p.fixed_s == pytest.approx(2 * (4 * 2.5 + vocab * 1.5))
    assert p.compute_s == pytest.approx(8 * (4 * 0.5 + vocab * 0.0))


def test_lora_on_the_last_blocks_runs_only_the_forward_below_them():
    w = Workload(PRESETS["small"], 128, 8, framework="torch")
    req = request_for(w, Adapters(8, 16.0, layers=1), (0, 64))
    figures = {"block_forward_s": 1.0, "block_step_s": 3.0, "head_forward_s": 0.0, "head_step_s": 0.0,
               "optimizer_s": 0.0, "optimizer_elements": 1}
    assert phases(figures, req, w).compute_s == pytest.approx(8 / req.rows * (1 * 3.0 + 3 * 1.0))


def test_what_the_run_measured_beyond_or_below_its_probe_is_added_to_the_model_never_below_the_ratio():
    from dataclasses import replace

    from common.costmodel.calibrate import calibrate
    from costmodel_fixtures import SPEC

    from common.model.spec import ModelSpec

    cal = calibrate(summary("torch", 1), ModelSpec.from_dict(SPEC))
    measured = cal.forward_s + cal.backward_s
    slower = transfer(cal, Phases(measured / 4, measured / 4, cal.optimizer_s))
    assert slower.compute_fixed_s == pytest.approx(measured / 2) and slower.compute_ratio == 1.0
    faster = transfer(replace(cal), Phases(measured, measured, cal.optimizer_s))
    assert faster.compute_fixed_s == pytest.approx(-measured) and faster.compute_ratio == pytest.approx(0.5)
    big = Phases(100 * measured, 300 * measured, 0.0)  # a model much larger than the run's: the difference taken off
    assert faster.apply(big).compute_s == pytest.approx(399 * measured)
    assert faster.apply(Phases(measured, measured, 0.0)).compute_s == pytest.approx(measured)  # its own model
    assert faster.apply(Phases(0.5 * measured, 0.5 * measured, 0.0)).compute_s == pytest.approx(0.5 * measured)


def test_each_size_is_probed_twice_alternately_and_a_slow_spell_in_one_run_is_not_taken_for_a_per_call_cost(monkeypatch):
    """The split reads the difference of the rows' and twice the rows' runs: a slow spell in one run (its timings
    1.4x) would be a per-call cost every rank pays whatever N. Each size runs twice, rows and twice the rows
    alternately; the per-call share is the faster runs', the level at the rows the two runs' mean."""
    import compare.plan.model_plan as model_plan
    from common.costmodel.probed import split_per_call

    w = Workload(PRESETS["small"], 128, 8, framework="torch")
    req = request_for(w, FullModel(), (0, 64))
    calls = []

    def probe_with_a_slow_spell(framework, r, environment):
        figures = fake_probe(framework, r, environment)
        calls.append(r.rows)
        slow = 1.4 if len(calls) == 1 else 1.0  # the first run, at the rows, in a slow spell
        return {k: v * slow if k.endswith("_s") else v for k, v in figures.items()}
    monkeypatch.setattr(model_plan, "run_probe", probe_with_a_slow_spell)
    figures = model_plan.probe("torch", req, {})
    assert calls == [req.rows, 2 * req.rows, req.rows, 2 * req.rows]
    clean = split_per_call(fake_probe("torch", req, {}), fake_probe("torch", replace(req, rows=2 * req.rows), {}),
                           req.rows, req.seq_len * req.vocab_rows)
    timings = ("block_forward_s", "block_step_s", "head_forward_s", "head_step_s", "optimizer_s")
    assert {k: figures[k] for k in timings} == pytest.approx({k: 1.2 * clean[k] for k in timings})  # (1.4 + 1) / 2
    assert all(figures[k[:-2] + "_fixed_s"] == pytest.approx(0.0) for k in timings[:4])  # no per-call part made up


def test_lora_on_a_quantized_base_holds_the_packed_base_and_trains_only_the_adapters():
    from common.model.quantize import Quantization

    spec = PRESETS["base"]
    w = Workload(spec, 128, 8, framework="mlx")
    lay = layout("ddp", 2)
    full = model_memory(lay, w, FullModel())
    lora = Adapters(8, 16.0)
    qlora = model_memory(lay, w, lora, Quantization(4, 64))
    adapters = lora.trained_parameters(spec) * 4
    assert qlora["gradients"] == adapters and qlora["optimizer"] == 2 * adapters
    assert qlora["weights"] == pytest.approx(Quantization(4, 64).base_bytes(spec) + adapters)
    assert qlora["weights"] < full["weights"] / 5 and qlora["total"] < full["total"]


def test_plan_model_predicts_each_framework_marks_the_fit_and_names_the_cheapest_change(runs, capsys):
    out = runs / "plan"
    code = main(["plan", "--from", str(runs / "mlx-n1"), "--from", str(runs / "torch-n1"), "--model",
                 str(runs / "llama"), "--nproc", "2", "--strategies", "ddp,fsdp", "--device-memory-gb", "6",
                 "--link-gbps", "10", "--latency-us", "50", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    plan = json.loads((out / "plan.json").read_text())
    assert plan["model"]["spec"]["n_layers"] == 12 and plan["model"]["trained"] is None
    rows = plan["predictions"]
    assert {r["framework"] for r in rows} == {"mlx", "torch"}
    for r in rows:
        assert {"strategy", "mesh", "world_size", "step_s", "tokens_per_s", "memory_bytes", "fits"} <= r.keys()
        parts = r["memory_bytes"]
        assert parts["total"] == pytest.approx(sum(v for k, v in parts.items() if k != "total"))
        assert {"weights", "gradients", "optimizer", "activations", "overhead"} <= parts.keys()
    ddp2 = [r for r in rows if r["strategy"] == "ddp" and r["world_size"] == 2]
    fsdp2 = [r for r in rows if r["strategy"] == "fsdp"]
    assert all(not r["fits"] for r in ddp2) and all(r["fits"] for r in fsdp2), [r["memory_bytes"]["total"] for r in rows]
    assert all(r["to_fit"].startswith("fsdp x2 fits") for r in ddp2)
    assert "does not fit: fsdp x2 fits" in printed


def test_ranks_sharing_a_machine_share_its_memory_and_one_rank_has_it_all(runs, capsys):
    """The same 6 GB shared by two ranks: fsdp x2 no longer fits (each rank has 3 GB), ddp x1 is judged against the
    whole machine (a job of one rank shares it with nobody)."""
    argv = ["plan", "--from", str(runs / "torch-n1"), "--model", str(runs / "llama"), "--nproc", "2", "--strategies",
            "ddp,fsdp", "--device-memory-gb", "6"]
    rows = {}
    for sharing in (1, 2):
        assert main([*argv, "--ranks-per-machine", str(sharing), "--out", str(runs / f"share{sharing}")]) == 0
        plan = json.loads((runs / f"share{sharing}" / "plan.json").read_text())
        assert plan["ranks_per_machine"] == sharing
        rows[sharing] = {(r["strategy"], r["world_size"]): r for r in plan["predictions"]}
    fsdp2 = rows[1][("fsdp", 2)]["memory_bytes"]["total"]
    assert 3e9 < fsdp2 <= 6e9 and rows[1][("fsdp", 2)]["fits"] and not rows[2][("fsdp", 2)]["fits"]
    assert rows[2][("ddp", 1)]["fits"] == rows[1][("ddp", 1)]["fits"] == (rows[1][("ddp", 1)]["memory_bytes"]["total"]
                                                                          <= 6e9)
    assert "shared by up to 2 ranks" in capsys.readouterr().out
    assert main([*argv, "--ranks-per-machine", "0"]) == 2
    assert "--ranks-per-machine must be a positive" in capsys.readouterr().err


def test_plan_model_with_lora_keeps_ddp_and_says_so(runs, capsys):
    code = main(["plan", "--from", str(runs / "torch-n1"), "--model", "base", "--lora-rank", "4", "--nproc", "2",
                 "--out", str(runs / "lora")])
    assert code == 0
    rows = json.loads((runs / "lora" / "plan.json").read_text())["predictions"]
    assert {r["strategy"] for r in rows} == {"ddp"} and "LoRA trains under ddp, zero1 and zero2 only" in capsys.readouterr().out


def bad_model_inputs(runs):
    no_config = runs / "empty"
    no_config.mkdir()
    refused = runs / "yarn"
    refused.mkdir()
    (refused / "config.json").write_text(json.dumps({**to_hf_config(PRESETS["tiny"]),
                                                     "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))
    act = runs / "gelu"
    act.mkdir()
    (act / "config.json").write_text(json.dumps({**to_hf_config(PRESETS["tiny"]), "hidden_act": "gelu"}))
    mlx = str(runs / "mlx-n1")
    return [
        (["plan", "--from", mlx, "--model", str(no_config)], "config.json not found"),
        (["plan", "--from", mlx, "--model", str(refused)], "not implemented"),
        (["plan", "--from", mlx, "--model", str(act)], "hidden_act = 'gelu' is not implemented"),
        (["plan", "--from", mlx, "--model", "tiny", "--frameworks", "torch"], "no torch run to calibrate on"),
        (["plan", "--from", mlx, "--model", "nosuch"], "no such preset, folder or config.json"),
        (["plan", "--from", mlx, "--model", "tiny", "--quantize-base", "4"], "needs --lora-rank"),
        (["plan", "--from", mlx, "--from", str(runs / "torch-n1")], "several --from runs are read with --model"),
    ]


def test_plan_model_refuses_bad_input_with_one_line_and_exit_2(runs, capsys):
    for argv, message in bad_model_inputs(runs):
        code = main(argv)
        err = capsys.readouterr().err
        assert code == 2, (argv, err)
        assert err.count("\n") == 1 and message in err and "Traceback" not in err, (argv, err)


def test_run_warns_when_its_ranks_would_not_fit_this_machine(monkeypatch):
    from common.config import RunConfig
    from compare.plan import model

    monkeypatch.setattr("common.costmodel.model_memory.machine_memory_bytes", lambda: 4e9)
    big = RunConfig.from_dict({"preset": "base", "nproc": 2, "seq_len": 512, "global_batch_size": 16})
    line = model.memory_warning(big, big.model_spec(50000))
    assert line and "exceeds the 4.0 GB this machine has available" in line and "\n" not in line
    small = RunConfig.from_dict({"preset": "tiny", "nproc": 2})
    assert model.memory_warning(small, small.model_spec(2048)) is None


def test_a_rank_of_a_job_of_several_holds_the_backends_fixed_bytes_beside_the_overhead_measured_at_one():
    from common.costmodel.model_memory import JOB_FIXED_BYTES, overhead_from_run

    w = Workload(PRESETS["small"], 128, 8, framework="mlx")
    one, two = model_memory(layout("ddp", 1), w, FullModel(), None, 1e8), model_memory(layout("ddp", 2), w, FullModel(), None, 1e8)
    assert two["overhead"] == one["overhead"] + JOB_FIXED_BYTES["mlx"]
    # calibrated on an N=2 run, the overhead is its peak less the parts and less the job's bytes: N=2 gives it back
    overhead = overhead_from_run(layout("ddp", 2), w, two["total"])
    assert overhead == pytest.approx(1e8) and model_memory(layout("ddp", 1), w, FullModel(), None, overhead)["total"] \
        == pytest.approx(one["total"])


def test_under_lora_ddp_reduces_the_adapters_gradients_only(runs):
    """1B's LoRA at N=2 was predicted at 65-81 % efficiency, 35 % of the step in an all-reduce of the whole model's
    gradients, where the measured runs scaled at ~100 %: the frozen base has no gradient to reduce."""
    w = Workload(PRESETS["base"], 128, 8, framework="torch")
    adapters = Adapters(8, 16.0)
    lora = Workload(PRESETS["base"], 128, 8, framework="torch",
                    trained_elements=int(adapters.trained_parameters(PRESETS["base"])))
    (full,) = layout("ddp", 2).collectives(w)
    (mine,) = layout("ddp", 2).collectives(lora)
    assert mine.nbytes * mine.calls == 4 * adapters.trained_parameters(PRESETS["base"]) < full.nbytes * full.calls / 50
    assert main(["plan", "--from", str(runs / "torch-n1"), "--model", str(runs / "llama"), "--lora-rank", "8",
                 "--nproc", "2", "--link-gbps", "10", "--latency-us", "50", "--out", str(runs / "lora-ddp")]) == 0
    (row,) = [r for r in json.loads((runs / "lora-ddp" / "plan.json").read_text())["predictions"] if r["world_size"] == 2]
    assert row["efficiency"] > 0.9, row


def test_a_fit_with_less_to_spare_than_the_predictions_error_is_marked_tight(runs, capsys):
    argv = ["plan", "--from", str(runs / "torch-n1"), "--model", str(runs / "llama"), "--nproc", "2", "--strategies",
            "fsdp", "--out", str(runs / "tight")]
    assert main([*argv, "--device-memory-gb", "100"]) == 0
    (row,) = [r for r in json.loads((runs / "tight" / "plan.json").read_text())["predictions"] if r["strategy"] == "fsdp"]
    assert row["fits"] and not row["tight"]
    capsys.readouterr()
    assert main([*argv, "--device-memory-gb", str(row["memory_bytes"]["total"] / 0.95 / 1e9)]) == 0
    (row,) = [r for r in json.loads((runs / "tight" / "plan.json").read_text())["predictions"] if r["strategy"] == "fsdp"]
    printed = capsys.readouterr().out
    assert row["fits"] and row["tight"] and "tight" in printed and "fsdp x2 fits with under 10% to spare" in printed


def test_the_mlx_probe_differentiates_only_what_each_timing_reads():
    """The block's timing holds the block and its input, the head's the head's modules and the input: over all the
    parts MLX writes a zeros gradient of every parameter the loss does not read (the head's vocabulary-sized matrices
    under the block's timing made `base`'s step predicted 33-64 % long)."""
    pytest.importorskip("mlx.core")
    from mlx.utils import tree_flatten

    from common.costmodel.probed import ProbeRequest
    from common.model.lora import FullModel
    from common.model.spec import preset
    from mlx_impl.block_probe import _holding, build, measure

    req = ProbeRequest(preset("tiny"), 2, 16, "float32", FullModel(), vocab_rows=64, optimizer_elements=4096,
                       budget_s=0.01)
    parts = build(req)
    block = dict(tree_flatten(_holding(parts, "block").trainable_parameters()))
    head = dict(tree_flatten(_holding(parts, "head").trainable_parameters()))
    assert "x" in block and "x" in head
    assert all(k == "x" or k.startswith("block.") for k in block) and any(k.startswith("block.") for k in block)
    assert "embed_tokens.weight" in head and not any(k.startswith("block.") for k in head)
    import mlx.core as mx

    mx.disable_compile()  # what is differentiated does not depend on the fused kernels, whose cold build took 35 s
    try:
        figures = measure(req)
    finally:
        mx.enable_compile()
    assert all(figures[k] > 0 for k in ("block_forward_s", "block_step_s", "head_forward_s", "head_step_s"))


def test_the_peak_is_the_heads_phase_where_the_vocabulary_outweighs_the_model_and_the_sum_elsewhere():
    """MLX's cross-entropy holds 4-6 logits-sized buffers at its peak where the summed parts count 2 (issue 56): with
    the probe's measured count the head phase (blocks' activations, state, what the head holds) is the peak of a
    small model with a large vocabulary, and the summed backward phase stays the peak of a model whose state
    outweighs its logits."""
    from dataclasses import replace

    from common.costmodel.model_memory import peak_phase

    small = Workload(PRESETS["small"].with_(vocab_size=50257), 128, 8, framework="mlx")
    lay = layout("ddp", 1)
    phase, summed = peak_phase(lay, small, FullModel(), None, 1e8)
    assert phase == "backward" and summed == model_memory(lay, small, FullModel(), None, 1e8)  # no probe: the sum
    phase, head = peak_phase(lay, replace(small, head_held=(5.0, 7e7)), FullModel(), None, 1e8)
    logits = lay.logits_bytes(small)
    assert phase == "head" and head["total"] > summed["total"]
    assert head["gradients"] == 7e7 and head["update"] == 0  # the head's own: MLX's others are the step's graph's
    assert head["activations"] - (summed["activations"] - 2 * 0.8 * logits) == pytest.approx(5.0 * logits)
    assert head["total"] == pytest.approx(sum(v for k, v in head.items() if k != "total"))
    # the same count on a model whose state outweighs its logits leaves the sum the peak
    big = Workload(PRESETS["base"].with_(n_layers=24, vocab_size=2048), 128, 8, framework="mlx", head_held=(5.0, 0.0))
    assert peak_phase(lay, big, FullModel(), None, 1e8)[0] == "backward"
    # torch's DDP keeps its gradients (bucket views) through the next step's head at N > 1, not at N = 1
    torch_small = replace(small, framework="torch", head_held=(5.0, 0.0))
    assert model_memory(layout("ddp", 2), torch_small, FullModel(), None, 1e8)["gradients"] > 0
    assert model_memory(layout("ddp", 1), torch_small, FullModel(), None, 1e8)["gradients"] == 0


def test_the_heads_peak_splits_into_what_the_rows_add_and_the_vocabulary_matrices_gradients():
    """The probe measures the head's resident peak at its rows and at twice them (as its timings): what the rows
    add is logits-sized buffers, the rest the vocabulary matrices' gradients, scaled to the model's vocabulary."""
    from common.costmodel.probed import head_held, split_per_call

    req = request_for(Workload(PRESETS["small"].with_(vocab_size=50257), 32, 2, framework="mlx"), FullModel(),
                      (0, 64))
    per_row = req.seq_len * req.vocab_rows
    logits = req.rows * per_row * 4
    grads = 2 * req.vocab_rows * req.spec.dim * 4
    once = {"head_peak_bytes": 3 * logits + grads} | {k: 1.0 for k in ("block_forward_s", "block_step_s",
                                                                        "head_forward_s", "head_step_s")}
    twice = {**once, "head_peak_bytes": 6 * logits + grads}
    split = split_per_call(once, twice, req.rows, per_row)
    assert split["head_logits"] == pytest.approx(3.0) and split["head_fixed_bytes"] == pytest.approx(grads)
    count, beside = head_held(split, req)
    assert count == pytest.approx(3.0) and beside == pytest.approx(2 * 50257 * req.spec.dim * 4)
    assert head_held(split_per_call(once, {**twice, "head_peak_bytes": None}, req.rows, per_row), req) is None


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc")
def test_the_probes_peak_counts_the_pages_a_call_touches_not_what_it_only_reserves():
    """common/metrics.py held_at_peak_rss, in a process of its own (it changes how that process's malloc maps)."""
    import subprocess
    import sys

    code = """
import numpy as np
from common.metrics import held_at_peak_rss
def touch():
    a = np.ones(16 * 2**20, dtype=np.float32)  # 64 MiB written
    b = np.empty(32 * 2**20, dtype=np.float32)  # 128 MiB reserved, never written
    return float(a.sum()) + b.nbytes * 0
def nothing():
    return sum(range(1000))
print(held_at_peak_rss(touch), held_at_peak_rss(nothing))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    touched, idle = (float(x) / 2**20 for x in out)
    # Linux's RSS counters lag by some pages a thread (63.9 MiB read once in 20 runs beside a busy loop on each
    # core): the bounds tell 64 MiB written from 192 reserved and from nothing, not the last page
    assert 60 <= touched < 64 + 16 and idle < 4


def test_runs_warning_counts_the_heads_logits_where_they_outweigh_the_model(monkeypatch):
    """A small model over a large vocabulary: the summed parts fit the machine, the head's logits-sized buffers
    (HEAD_LOGITS_UNPROBED of them, as the probe measured) do not, and the run is warned."""
    from dataclasses import replace

    from common.config import RunConfig
    from common.costmodel.model_memory import HEAD_LOGITS_UNPROBED, peak_phase
    from compare.plan import model

    cfg = RunConfig.from_dict({"preset": "small", "nproc": 1, "seq_len": 512, "global_batch_size": 16,
                               "op_profile": False})
    spec = cfg.model_spec(128256)
    w = Workload(spec, 512, 16, framework=cfg.framework)
    summed = model_memory(cfg.layout, w)["total"]
    phase, head = peak_phase(cfg.layout, replace(w, head_held=(HEAD_LOGITS_UNPROBED, 0.0)))
    assert phase == "head" and head["total"] > summed
    monkeypatch.setattr("common.costmodel.model_memory.machine_memory_bytes", lambda: (summed + head["total"]) / 2)
    line = model.memory_warning(cfg, spec)
    assert line and f"predicted peak {head['total'] / 1e9:.1f} GB per rank" in line
