"""FSDP (--strategy fsdp) computes what DDP computes, in both frameworks, while each rank holds 1/N of
the state: losses and gradients equal DDP's step by step, MLX and torch agree, and checkpoints stay full
so a run switches strategy (and framework) at a checkpoint. Each test starts real processes via the CLI."""
import numpy as np
import pytest
from safetensors.numpy import load_file

from helpers import FAST, dpcompare, losses, summary
from integration.runs import resumed_from, rewound

FRAMEWORKS = ["mlx", "torch"]


def run(cache_dir, out, *extra):
    dpcompare("run", *FAST, "--out", out, *extra, cache_dir=cache_dir)
    return losses(out)


@pytest.mark.slow
@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("sequence, grad_accum", [("packing", 1), ("padding", 2)])
def test_fsdp_matches_ddp_step_by_step_with_half_the_state_per_rank(framework, sequence, grad_accum, uninterrupted,
                                                                     padded):
    # The session's runs at 2 ranks (integration/conftest.py): 20 steps packed, or 10 steps padded.
    if sequence == "packing":
        ddp_dir, fsdp_dir = uninterrupted(framework, "ddp", 2), uninterrupted(framework, "fsdp", 2)
    else:
        ddp_dir, fsdp_dir = padded(framework, 2, grad_accum), padded(framework, 2, grad_accum, "fsdp")
    np.testing.assert_allclose(losses(fsdp_dir), losses(ddp_dir), rtol=0, atol=1e-5)

    a, b = summary(ddp_dir), summary(fsdp_dir)
    assert (a["strategy"], a["reduce_scatter"]) == ("ddp", None)
    # MLX on ring has no native reduce-scatter (mlx 0.32.4): all_sum + slice; torch's gloo has one.
    assert (b["strategy"], b["reduce_scatter"]) == ("fsdp", {"mlx": "all_sum_slice", "torch": "native"}[framework])
    for part in ("params", "grads", "optimizer"):
        assert len(b["state_bytes"][part]) == 2
        # tiny: every parameter shards evenly over 2 ranks except the final norm (replicated in MLX).
        for sharded, replicated in zip(b["state_bytes"][part], a["state_bytes"][part]):
            assert 0.45 * replicated <= sharded <= 0.55 * replicated, (part, sharded, replicated)
    # What a rank read of the seed is what it keeps: the whole model under ddp, its rows under fsdp (counted
    # by common/checkpoint/tensorsource.py), so no fsdp rank ever read a whole sharded tensor.
    assert a["weights_bytes_read"] == a["state_bytes"]["params"]
    assert b["weights_bytes_read"] == b["state_bytes"]["params"]


@pytest.mark.slow
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_an_uneven_vocabulary_trains_exactly_and_step_1_gradients_equal_ddps_parameter_by_parameter(
        framework, cache_dir, tmp_path):
    """513 tokens over 2 ranks: both frameworks pad the embedding and head to 514 rows and shard them (MLX by
    hand, mlx_impl/fsdp.py; FSDP2 inside), and the files keep the true 513 rows.

    After one AdamW step from zero moments, exp_avg = (1 - beta1) * gradient: the step-1 checkpoints hold the
    gradients. Averaging them as a sum (FSDP2 on gloo, pytorch issue 162338) would make them 2x DDP's,
    which the loss alone would hide (Adam is almost scale invariant); grad_clip=0, since clipping would too.
    (One pair of runs for both properties, the padded rows among the gradients compared; 2 steps, since only
    the last 2 checkpoints are kept, common/checkpoint/store.py.)"""
    common = ("--framework", framework, "--nproc", 2, "--steps", 2, "--set", "model.vocab_size=513",
              "--set", "grad_clip=0", "--checkpoint-every", 1)
    ddp = run(cache_dir, tmp_path / "ddp", *common, "--strategy", "ddp")
    fsdp = run(cache_dir, tmp_path / "fsdp", *common, "--strategy", "fsdp")
    np.testing.assert_allclose(fsdp, ddp, rtol=0, atol=1e-5)
    held = summary(tmp_path / "fsdp")["state_bytes"]["params"][0] / summary(tmp_path / "ddp")["state_bytes"]["params"][0]
    assert len(ddp) == 2 and 0.45 < held < 0.55, held  # was 0.71 in MLX, the vocabulary replicated
    saved = load_file(str(tmp_path / "fsdp" / "checkpoints" / "step_000002" / "model.safetensors"))
    assert saved["model.embed_tokens.weight"].shape[0] == saved["lm_head.weight"].shape[0] == 513

    ddp, fsdp = (load_file(str(tmp_path / s / "checkpoints" / "step_000001" / "optimizer.safetensors"))
                 for s in ("ddp", "fsdp"))
    assert ddp.keys() == fsdp.keys()
    assert ddp["exp_avg.model.embed_tokens.weight"].shape[0] == 513, ddp.keys()
    for name in ddp:
        if name.startswith("exp_avg."):
            scale = float(np.abs(ddp[name]).max())
            np.testing.assert_allclose(fsdp[name], ddp[name], rtol=0, atol=1e-5 * scale, err_msg=name)


@pytest.mark.slow
def test_mlx_fsdp_and_torch_fsdp_agree_step_by_step(uninterrupted):
    mlx, torch = losses(uninterrupted("mlx", "fsdp", 2)), losses(uninterrupted("torch", "fsdp", 2))  # 20 steps, lr 1e-3
    np.testing.assert_allclose(mlx, torch, rtol=0, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("first, second, atol", [
    (("mlx", "ddp"), ("mlx", "fsdp"), 1e-6),
    (("mlx", "fsdp"), ("mlx", "ddp"), 1e-6),
    (("torch", "fsdp"), ("torch", "ddp"), 1e-6),
    # across frameworks, at their usual fp32 parity; it also loads a full checkpoint into torch FSDP,
    # which is what torch ddp -> torch fsdp would check (left out to keep CI short)
    (("mlx", "fsdp"), ("torch", "fsdp"), 1e-4),
])
def test_a_checkpoint_resumes_under_another_strategy_as_the_uninterrupted_run(first, second, atol, uninterrupted,
                                                                              cache_dir, tmp_path):
    common = ("--nproc", 2, "--lr-decay-steps", 20, "--lr", "1e-3")
    (fw1, s1), (fw2, s2) = first, second
    straight = losses(uninterrupted(fw2, s2, 2))  # 20 steps on the same horizon
    switched = rewound(uninterrupted(fw1, s1, 2), tmp_path / "switched")  # fw1 s1's first 10 steps
    resumed = run(cache_dir, switched, *common, "--framework", fw2, "--strategy", s2, "--steps", 20, "--resume")
    assert len(resumed) == 20 and resumed_from(switched) == 10
    np.testing.assert_allclose(resumed, straight, rtol=0, atol=atol)
    # The resumed ranks read their own part of the checkpoint's weights and of both moments, nothing more.
    s = summary(switched)
    assert s["weights_bytes_read"] == s["state_bytes"]["params"]
    assert s["moments_bytes_read"] == [2 * held for held in s["state_bytes"]["params"]]
