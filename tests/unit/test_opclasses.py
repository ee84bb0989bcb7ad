"""The op-class profile's bookkeeping (common/train/opclasses.py, opprofile.py) and what the report makes of it:
the classes' work and lower bounds, what is outside them, the class that explains a speed gap, and the table,
from run directories written with the real schema (fake_runs.py)."""
from __future__ import annotations

import json
import time

import pytest

from common.config import RunConfig
from common.model.flops import attention_flops_per_token, flops_per_token, matmul_parameters
from common.model.lora import Adapters
from common.model.spec import preset
from common.train.opclasses import (OP_CLASSES, class_work, difference_sentence, largest_difference, lower_bound_s,
                                    ms)
from common.train.opprofile import MAX_REPS, MIN_REPS, TOLERANCE, memory_bandwidth_Bps, profile, summarize
from compare.flags import add_run_flags, config_from_args
from compare.report.opclass_table import opclass_blocks
from compare.report.parity import Tolerances
from compare.report.writer import write_report
from unit.fake_runs import make_run, op_profile_of

CONTEXT = {"peaks": {"mlx": {"flops": 50e9, "device": "cpu", "threads": 1, "blas": "openblas"},
                     "torch": {"flops": 100e9, "device": "cpu", "threads": 1, "blas": "mkl"}}, "accelerator": None}
# The example: MLX's step pays 1,950 ms in softmax/cross-entropy, torch's 360.
MLX_MS = {"matmul": 600.0, "attention": 150.0, "softmax/cross-entropy": 1950.0, "norms/activations/RoPE": 240.0,
          "optimizer": 60.0}
TORCH_MS = {"matmul": 560.0, "attention": 120.0, "softmax/cross-entropy": 360.0, "norms/activations/RoPE": 90.0,
            "optimizer": 40.0}


def test_matmul_and_attention_work_is_the_mfu_count_with_the_causal_half_of_attention():
    spec = preset("small")
    work = class_work(spec, micro_batch=4, seq_len=256, grad_accum=2, dtype="float32")
    tokens = 4 * 256 * 2
    attention_full = attention_flops_per_token(spec, 256) * tokens
    assert work["attention"]["flops"] == pytest.approx(attention_full / 2)
    assert work["matmul"]["flops"] + 2 * work["attention"]["flops"] == pytest.approx(flops_per_token(spec, 256) * tokens)
    # The loss reads every float32 logit and writes its gradient: 2 x 4 bytes x vocab per token.
    assert work["softmax/cross-entropy"]["bytes"] == 8 * spec.vocab_size * tokens
    half = class_work(spec, 4, 256, 2, "bfloat16")["norms/activations/RoPE"]["bytes"]
    assert half == work["norms/activations/RoPE"]["bytes"] / 2  # activations move in the compute dtype
    assert work["optimizer"]["bytes"] == class_work(spec, 1, 8, 1, "float32")["optimizer"]["bytes"]  # per parameter


def test_under_lora_the_bounds_count_no_weight_gradient_of_the_frozen_base_and_update_the_adapters_alone():
    spec = preset("small")
    full = class_work(spec, 4, 256, 2, "float32")
    lora = Adapters(rank=8, alpha=16.0, targets=("q_proj", "v_proj"))
    work = class_work(spec, 4, 256, 2, "float32", lora)
    tokens, n, adapters = 4 * 256 * 2, matmul_parameters(spec), lora.trained_parameters(spec)
    # the base forward and its input's gradient (2 N each), the adapters' two products forward and backward (6)
    assert work["matmul"]["flops"] == pytest.approx((4 * n + 6 * adapters) * tokens)
    assert work["matmul"]["flops"] < full["matmul"]["flops"] == pytest.approx(6 * n * tokens)
    assert work["optimizer"]["bytes"] == 32 * adapters  # AdamW over the adapters: 8 float32 passes each
    for name in ("attention", "softmax/cross-entropy", "norms/activations/RoPE"):  # every block runs a backward
        assert work[name] == full[name], name
    # adapters on the last of 4 blocks: the 3 below run forward alone, their input gradients never computed
    top = class_work(spec, 4, 256, 2, "float32", Adapters(8, 16.0, ("q_proj", "v_proj"), layers=1))
    head = spec.vocab_size * spec.dim
    per_block = (n - head) / spec.n_layers
    assert top["matmul"]["flops"] == pytest.approx((2 * n + 2 * (per_block + head) + 6 * (adapters / 4)) * tokens)
    assert top["attention"]["flops"] == pytest.approx(full["attention"]["flops"] * (2 * 4 + 4 * 1) / (6 * 4))
    assert work["norms/activations/RoPE"]["bytes"] > top["norms/activations/RoPE"]["bytes"]


def test_lower_bounds_use_the_peak_for_flops_and_the_bandwidth_for_bytes():
    assert lower_bound_s({"flops": 2e9, "bytes": None}, peak_flops=1e11, bandwidth_Bps=1e10) == pytest.approx(0.02)
    assert lower_bound_s({"flops": None, "bytes": 1e9}, peak_flops=1e11, bandwidth_Bps=1e10) == pytest.approx(0.1)
    assert lower_bound_s({"flops": 2e9, "bytes": None}, peak_flops=None, bandwidth_Bps=1e10) is None


def test_what_the_classes_do_not_cover_is_outside_and_the_tolerance_says_when_it_is_too_much():
    work = class_work(preset("tiny"), 8, 32, 1, "float32")
    close = summarize([{"matmul": 0.004, "attention": 0.002, "reference_step_s": 0.0065}] * 3, work)
    assert close["class_sum_s"] == pytest.approx(0.006) and close["outside_s"] == pytest.approx(0.0005)
    assert close["within_tolerance"] and close["tolerance"] == TOLERANCE == 0.15
    assert "embedding" in close["outside"]
    far = summarize([{"matmul": 0.004, "attention": 0.002, "reference_step_s": 0.010}] * 3, work)
    assert not far["within_tolerance"] and far["outside_share"] == pytest.approx(0.4)
    over = summarize([{"matmul": 0.008, "attention": 0.004, "reference_step_s": 0.010}] * 3, work)
    assert not over["within_tolerance"] and over["outside_s"] < 0  # classes that lose the step's fusion
    median = summarize([{"matmul": t, "reference_step_s": 0.01} for t in (0.001, 0.009, 0.002)], work)
    assert median["classes"]["matmul"]["s"] == 0.002 and median["classes"]["matmul"]["spread"][0] < 0.002


def test_the_classes_sum_is_the_median_rep_so_that_spikes_in_different_classes_are_not_all_dropped():
    # A preempted call slows one class of one rep; the step beside it is as long as all the classes together.
    reps = [{"matmul": 0.009, "attention": 0.002, "reference_step_s": 0.011},
            {"matmul": 0.004, "attention": 0.007, "reference_step_s": 0.011},
            {"matmul": 0.004, "attention": 0.002, "reference_step_s": 0.006}]
    record = summarize(reps, class_work(preset("tiny"), 8, 32, 1, "float32"))
    assert record["classes"]["matmul"]["s"] + record["classes"]["attention"]["s"] == pytest.approx(0.006)
    assert record["class_sum_s"] == pytest.approx(0.011) and record["outside_s"] == pytest.approx(0.0)


def test_what_is_outside_is_each_reps_step_minus_its_own_classes_so_load_that_drifts_cancels():
    # The machine's load tripled for the last rep, and a spike hit the classes of the second: each rep's own step
    # says 10 % is outside; comparing the medians of steps and sums apart would say -40 %.
    reps = [{"matmul": 0.009, "reference_step_s": 0.010}, {"matmul": 0.014, "reference_step_s": 0.010},
            {"matmul": 0.027, "reference_step_s": 0.030}]
    record = summarize(reps, class_work(preset("tiny"), 8, 32, 1, "float32"))
    assert record["outside_share"] == pytest.approx(0.1) and record["outside_s"] == pytest.approx(0.001)
    assert record["within_tolerance"] and len(record["rounds"]) == 3


class _Clock:
    """common/train/opprofile.py's clock, simulated: the fake workloads move it by their cost, each reading by 1 us
    (so a memory copy takes time too). Real sleeps overshoot on a busy machine, and the figures below are exact."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1e-6
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class _Trainer:
    """Workloads that take known times: a class's figure is its parts' times, each times its count per step."""

    def __init__(self, clock=time):
        self.steps, self.calls = 0, 0
        self.sleep = clock.sleep

    def op_workloads(self, batch, grad_accum):
        def sleep(s):
            def run():
                self.calls += 1
                self.sleep(s)
            return run
        return {"matmul": [(sleep(0.002), 2 * grad_accum), (sleep(0.001), grad_accum)],
                "optimizer": [(sleep(0.001), 1)]}

    def train_step(self, batches, lr, global_tokens, **_):
        self.steps += 1
        self.sleep(0.006)


def test_profile_times_each_class_with_its_counts_and_stops_at_its_budget(monkeypatch):
    import common.train.opprofile as opprofile

    clock = _Clock()
    monkeypatch.setattr(opprofile, "time", clock)
    trainer = _Trainer(clock)
    record = profile(trainer, ([None], 1e-3, 1), preset("tiny"), 8, 32, 2, "float32", budget_s=60)
    # two steps a rep, the second timed (opprofile.py); the classes once more for the warmup
    assert record["reps"] == MAX_REPS and trainer.steps == 2 * MAX_REPS and trainer.calls == 3 * (MAX_REPS + 1)
    assert 0.010 <= record["classes"]["matmul"]["s"] < 0.015  # 2 x 2 x 2 ms + 2 x 1 ms
    assert record["classes"]["matmul"]["flops"] > 0 and record["shapes"]["grad_accum"] == 2
    assert record["wall_s"] >= record["build_s"] + record["warmup_s"] and record["memory_bandwidth_Bps"] > 1e8
    trainer = _Trainer(clock)
    assert profile(trainer, ([None], 1e-3, 1), preset("tiny"), 8, 32, 1, "float32", budget_s=0.0)["reps"] == MIN_REPS


def test_memory_bandwidth_is_a_plausible_rate():
    assert 1e8 < memory_bandwidth_Bps(nbytes=8 << 20) < 1e13


def test_the_class_that_explains_the_gap_comes_with_both_costs_and_its_share():
    mlx, torch = op_profile_of(MLX_MS, step_ms=3100), op_profile_of(TORCH_MS, step_ms=1200)
    d = largest_difference(torch, mlx)
    assert d["class"] == "softmax/cross-entropy" and d["share"] == pytest.approx(1590 / 1900)
    assert difference_sentence(d, "torch", "mlx") == \
        "softmax/cross-entropy: 1,950 ms in mlx vs 360 ms in torch, 84% of the gap"
    # Steps that do not differ in the runs' direction leave the share out rather than invent one.
    same = largest_difference(torch, op_profile_of(MLX_MS, step_ms=1100))
    assert same["share"] is None and difference_sentence(same, "torch", "mlx").endswith("360 ms in torch")
    assert largest_difference(None, mlx) is None and difference_sentence(None, "a", "b") is None
    # The class that explains the gap is one the slower run pays more for, not the largest difference either way:
    # a faster matmul in the slower run explains none of its gap.
    slow = op_profile_of({**MLX_MS, "matmul": 300.0, "softmax/cross-entropy": 600.0}, step_ms=1400)
    d = largest_difference(torch, slow)
    assert d["class"] == "softmax/cross-entropy" and d["share"] == pytest.approx(240 / 200)
    assert (ms(1.95), ms(0.0361), ms(0.00042)) == ("1,950", "36.1", "0.42")


@pytest.mark.usefixtures("no_figures")
def test_the_speed_verdict_names_the_op_class_and_the_report_tables_every_class(tmp_path):
    dirs = [make_run(tmp_path, "mlx", 1, tokens_per_s=2_600, op_profile=op_profile_of(MLX_MS, 3100)),
            make_run(tmp_path, "torch", 1, tokens_per_s=7_300, op_profile=op_profile_of(TORCH_MS, 1200)),
            make_run(tmp_path, "mlx", 2, tokens_per_s=4_000)]  # N>1: no profile, no op column
    summary = write_report(dirs, tmp_path / "report", Tolerances(), CONTEXT)
    at_one = next(s for s in summary["speed"] if s["world_size"] == 1)
    assert at_one["op_class"]["class"] == "softmax/cross-entropy"
    assert at_one["op_class_gap"] == "softmax/cross-entropy: 1,950 ms in mlx vs 360 ms in torch, 84% of the gap"
    md = (tmp_path / "report" / "report.md").read_text()
    assert "| MLX vs torch | mlx x1 vs torch x1 | torch |" in md and at_one["op_class_gap"] in md
    assert "## Op classes" in md and "| op class | lower bound ms | mlx x1 ms | torch x1 ms |" in md
    for name in OP_CLASSES:
        assert f"| {name} | " in md
    work = class_work(preset("tiny"), 8, 32, 1, "float32")
    assert work["softmax/cross-entropy"]["bytes"] == 8 * 2048 * 256  # 4.2 MB: 0.42 ms at the 10 GB/s measured
    assert "| softmax/cross-entropy | 0.42 | 1,950 | 360 |" in md
    assert "| outside the classes |  | 100 (+3%) | 30.0 (+2%) |" in md
    # The bound of a FLOP class uses the faster measured peak, as MFU does: tiny's matmuls at 100 GFLOP/s.
    assert f"| matmul | {ms(work['matmul']['flops'] / 100e9)} |" in md
    rebuilt = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert rebuilt["runs"][0]["op_profile"]["classes"]["matmul"]["s"] == pytest.approx(0.6)


def _notes(blocks: list[tuple]) -> list[str]:
    return [item for block in blocks if block[0] == "ul" for item in block[1]]


def test_a_profile_whose_classes_miss_the_step_is_named_under_the_table():
    row = {"label": "torch x1", "world_size": 1, "dtype": "float32", "peak_flops": 1e11,
           "op_profile": op_profile_of(TORCH_MS, 2100)}
    assert "torch x1: the classes add up to 1,170 ms against a 2,100 ms step (+44% outside" in _notes(opclass_blocks([row]))[0]


def test_a_profile_that_failed_says_why_and_the_others_are_still_tabled():
    failed = {"label": "mlx x1", "world_size": 1, "dtype": "float32", "op_profile": {"error": "RuntimeError: no"}}
    good = {"label": "torch x1", "world_size": 1, "dtype": "float32", "op_profile": op_profile_of(TORCH_MS, 1200)}
    blocks = opclass_blocks([failed, good])
    assert _notes(blocks) == ["mlx x1: the op profile failed (RuntimeError: no)"]
    assert next(b for b in blocks if b[0] == "table")[1] == ("op class", "lower bound ms", "torch x1 ms")
    assert largest_difference(good["op_profile"], failed["op_profile"]) is None


def test_the_op_profile_is_on_by_default_and_a_flag_turns_it_off():
    import argparse

    parser = argparse.ArgumentParser()
    add_run_flags(parser)
    assert RunConfig().op_profile is True
    assert config_from_args(parser.parse_args([])).op_profile is True
    assert config_from_args(parser.parse_args(["--no-op-profile"])).op_profile is False
    assert config_from_args(parser.parse_args(["--op-profile"])).op_profile is True
