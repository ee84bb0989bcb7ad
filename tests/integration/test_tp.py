"""Tensor parallelism (--strategy tp): each layer split over the ranks, every rank reading the whole global
batch, so N tp ranks compute what one ddp rank computes; checkpoints move between strategies."""
import json

import numpy as np
import pytest

from helpers import FAST, dpcompare, losses, summary
from common.model.spec import ModelSpec
from common.parallel.tp import tp_split_axis
from common.model.weights import parameter_shapes
from integration.runs import reference_flags, switched_at_a_checkpoint

FRAMEWORKS = ["mlx", "torch"]
TP = ("--set", "strategy=tp", "--nproc", 2)


def run(cache_dir, out, *extra):
    dpcompare("run", *FAST, "--out", out, *extra, cache_dir=cache_dir)
    return losses(out)


def grad_norms(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["grad_norm"] for r in rows if "grad_norm" in r]


def eval_losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["eval_loss"] for r in rows if "eval_loss" in r]


# ---- the CLI ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("sequence", ["packing", "padding"])
def test_tp_two_ranks_equal_one_ddp_rank_with_the_same_global_batch(framework, sequence, ddp_one, uninterrupted,
                                                                   cache_dir, tmp_path):
    if sequence == "packing":  # the session's 20-step tp x2 and ddp x1 runs (integration/conftest.py; measured max
        # |dloss| 1.2e-7): no clipping and no eval there, which the padding case judges in each framework
        ddp1, tp2 = uninterrupted(framework, "ddp", 1), uninterrupted(framework, "tp", 2)
    else:
        # grad_clip below the norms (~0.9): the clipped update depends on the global norm counting each parameter
        # once (reference_flags; the ddp x1 reference is shared with test_pp.py: integration/conftest.py).
        ddp1, tp2 = ddp_one(framework, sequence), tmp_path / "tp2"
        run(cache_dir, tp2, *reference_flags(framework, sequence), *TP)
        assert eval_losses(ddp1)
    assert len(losses(tp2)) == len(losses(ddp1)) == (20 if sequence == "packing" else 10)
    np.testing.assert_allclose(losses(tp2), losses(ddp1), rtol=0, atol=1e-5)
    np.testing.assert_allclose(grad_norms(tp2), grad_norms(ddp1), rtol=1e-5)
    # Every tp rank holds the whole eval loss: summed over data-parallel ranks only, it is not doubled.
    np.testing.assert_allclose(eval_losses(tp2), eval_losses(ddp1), rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_tp_holds_a_share_of_the_layers_and_measures_the_estimated_communication(framework, cache_dir, tmp_path):
    out = tmp_path / "tp"
    # bf16: the activations all-reduced are half the bytes (the parameters, gradients and AdamW state stay
    # float32: common/model/precision.py), and the estimate must say so.
    run(cache_dir, out, "--framework", framework, "--steps", 3, "--grad-accum", 2, "--sequence", "padding",
        "--dtype", "bfloat16", *TP)
    s = summary(out)
    spec = ModelSpec.from_dict(json.loads((out / "run_config.json").read_text())["spec"])
    shapes = parameter_shapes(spec)
    replicated = sum(int(np.prod(v)) for k, v in shapes.items() if tp_split_axis(k) is None)
    sharded = sum(int(np.prod(v)) for k, v in shapes.items() if tp_split_axis(k) is not None)
    state = s["state_bytes"]  # {"params": [per rank], "grads": [...], "optimizer": [...]}
    for params, grads, optimizer in zip(state["params"], state["grads"], state["optimizer"]):
        assert params == grads == 4 * (replicated + sharded // 2)
        assert 2 * params <= optimizer <= 2 * params + 1024
    # Each rank read its blocks of the seed and the replicated tensors, never a whole split tensor.
    assert s["weights_bytes_read"] == state["params"]
    assert s["comm_bytes_per_step"] == s["comm_bytes_per_step_estimate"] == 4 * spec.n_layers * 8 * 32 * spec.dim * 2


@pytest.mark.slow
def test_mlx_tp_and_torch_tp_agree_step_by_step(uninterrupted):
    mlx, torch = losses(uninterrupted("mlx", "tp", 2)), losses(uninterrupted("torch", "tp", 2))  # 20 steps, lr 1e-3
    np.testing.assert_allclose(mlx, torch, rtol=0, atol=1e-4)
    for framework in ("mlx", "torch"):  # float32: the estimate against what the collectives counted
        s = summary(uninterrupted(framework, "tp", 2))
        assert s["comm_bytes_per_step"] == s["comm_bytes_per_step_estimate"] > 0


STRATEGY = {"ddp": ("--nproc", 1), "tp": TP}


@pytest.mark.slow
@pytest.mark.parametrize("first, second, atol", [
    # mlx tp -> torch tp also loads a full checkpoint into torch TP, as torch ddp -> torch tp would
    ("mlx ddp", "mlx tp", 1e-6), ("mlx tp", "mlx ddp", 1e-6), ("torch tp", "torch ddp", 1e-6),
    ("mlx tp", "torch tp", 1e-4)])
def test_a_checkpoint_resumed_under_another_strategy_continues_the_same_curve(first, second, atol, uninterrupted,
                                                                              cache_dir, tmp_path):
    resumed, straight = switched_at_a_checkpoint(first, second, STRATEGY, uninterrupted, cache_dir, tmp_path)
    assert len(resumed) == 20
    np.testing.assert_allclose(resumed, straight, rtol=0, atol=atol)
