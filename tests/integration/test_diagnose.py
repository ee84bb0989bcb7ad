"""`dpcompare diagnose` names where the frameworks part: real bugs, planted in one framework at a time
(DPCOMPARE_INJECT_BUG), are found at the right stage and module, in both directions."""
import json

import pytest

from helpers import FAST, dpcompare
from compare.diagnose import RTOL, compare_stores, run_worker
from compare.cli import config_from_args, build_parser

pytestmark = pytest.mark.slow
# Padding mode with sequences longer than many stories, so the loss mask has zeros to forget; LoRA (peft's default
# q_proj and v_proj), so that the adapters over a frozen base are what is recorded (a full fine-tune is diagnosed
# from a checkpoint below).
SETUP = [*FAST, "--sequence", "padding", "--seq-len", "256", "--lora-rank", "4"]
WHERE = {
    "rmsnorm_eps": ("forward", "model.layers.0.input_layernorm"),
    "rope_layout": ("forward", "model.layers.0.self_attn.rope"),
    "loss_mask": ("loss", "loss"),
    # lora_A starts random and lora_B at zero: A's first gradient is zero, so B's update is the first to part
    "adamw_bias_correction": ("update", "model.layers.0.self_attn.q_proj.lora_B"),
}


@pytest.fixture(scope="module")
def clean(cache_dir, tmp_path_factory):
    """Both frameworks' records of the same step, through the CLI, tensors kept for the bug tests."""
    out = tmp_path_factory.mktemp("diagnose") / "clean"
    proc = dpcompare("diagnose", *SETUP, "--out", out, "--keep-tensors", cache_dir=cache_dir)
    return out, proc.stdout, json.loads((out / "diagnosis.json").read_text())


def test_identical_setups_agree_at_every_module_gradient_and_update(clean):
    out, stdout, result = clean
    assert result["first_divergence"] is None
    assert "agree at every module" in stdout and "stage" in stdout
    forward = [row["name"] for row in result["stages"]["forward"]]
    assert forward[0] == "model.embed_tokens" and forward[-1] == "logits"
    assert {"model.layers.0.input_layernorm", "model.layers.1.mlp.down_proj", "model.layers.0.self_attn.rope#2",
            "model.norm", "lm_head"} <= set(forward)
    gradient = [row["name"] for row in result["stages"]["gradient"]]  # what trains: the adapters, in forward order
    assert gradient[:2] == ["model.layers.0.self_attn.q_proj.lora_A", "model.layers.0.self_attn.q_proj.lora_B"]
    assert all(".lora_" in name for name in gradient) and len(result["stages"]["update"]) == len(gradient) >= 8
    assert all(not row["diverges"] for rows in result["stages"].values() for row in rows)
    assert abs(result["loss"]["mlx"] - result["loss"]["torch"]) < 1e-5


@pytest.mark.parametrize("framework", ["mlx", "torch"])
@pytest.mark.parametrize("bug", list(WHERE))
def test_a_planted_bug_is_found_at_its_stage_and_module(bug, framework, clean, cache_dir, tmp_path, monkeypatch):
    out, _, _ = clean
    monkeypatch.setenv("DPCOMPARE_INJECT_BUG", f"framework={framework},bug={bug}")
    monkeypatch.setenv("DPCOMPARE_CACHE", str(cache_dir))
    cfg = config_from_args(build_parser().parse_args(["diagnose", *map(str, SETUP)]), framework=framework)
    buggy = tmp_path / framework
    run_worker(cfg, out / "diagnose_plan.json", buggy, tmp_path)
    other = out / "tensors" / ("torch" if framework == "mlx" else "mlx")
    result = compare_stores(buggy, other, RTOL["float32"])
    first = result["first_divergence"]
    assert (first["stage"], first["module"]) == WHERE[bug], first
    assert first["max_abs_diff"] > 10 * first["tolerance"]
    assert result["injected_bugs"] == {framework: bug}


def test_a_run_checkpoint_is_diagnosed_at_the_next_step(uninterrupted, cache_dir, tmp_path):
    run = uninterrupted("torch", "ddp", 1)  # the session's 20-step run, checkpointed at steps 10 and 20
    out = tmp_path / "diag"
    dpcompare("diagnose", "--from", run, "--step", 10, "--out", out, cache_dir=cache_dir)
    result = json.loads((out / "diagnosis.json").read_text())
    assert result["step"] == 11 and result["weights"].endswith("step_000010")
    assert result["first_divergence"] is None
    assert not (out / "tensors").exists()
