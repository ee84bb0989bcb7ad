"""Tensor parallelism (--strategy tp): each layer split over the ranks, every rank reading the whole global
batch, so N tp ranks compute what one ddp rank computes; checkpoints move between strategies."""
import json

import numpy as np
import pytest

from helpers import FAST, dpcompare, losses, summary
from common.errors import UserError
from common.spec import ModelSpec, preset
from common.strategy import check_strategy, comm_bytes_per_step_estimate, tp_shard, tp_split_axis
from common.weights import parameter_shapes

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


# ---- the split, framework-neutral ------------------------------------------------------------------------
def test_column_parallel_layers_split_rows_row_parallel_layers_split_columns_the_rest_is_replicated():
    assert tp_split_axis("model.layers.0.self_attn.q_proj.weight") == 0
    assert tp_split_axis("model.layers.3.mlp.up_proj.weight") == 0
    assert tp_split_axis("model.layers.0.self_attn.o_proj.weight") == 1
    assert tp_split_axis("model.layers.1.mlp.down_proj.weight") == 1
    for name in ("model.embed_tokens.weight", "model.layers.0.input_layernorm.weight", "model.norm.weight",
                 "lm_head.weight"):
        assert tp_split_axis(name) is None


def test_each_rank_gets_the_query_heads_its_kv_heads_serve():
    spec = preset("tiny")  # 4 heads, 2 kv heads, head_dim 16: kv head j serves query heads 2j, 2j+1
    q = np.repeat(np.arange(spec.n_heads), spec.head_dim)[:, None]          # q_proj rows, labelled by head
    k = np.repeat(np.arange(spec.n_kv_heads), spec.head_dim)[:, None]
    group = spec.n_heads // spec.n_kv_heads
    for rank in range(2):
        q_heads = np.unique(tp_shard("l.self_attn.q_proj.weight", q, rank, 2))
        kv_heads = np.unique(tp_shard("l.self_attn.k_proj.weight", k, rank, 2))
        assert sorted(set(q_heads // group)) == list(kv_heads)
    pieces = [tp_shard("l.mlp.down_proj.weight", np.arange(12).reshape(2, 6), r, 3) for r in range(3)]
    np.testing.assert_array_equal(np.concatenate(pieces, axis=1), np.arange(12).reshape(2, 6))


@pytest.mark.parametrize("field, changes", [("n_heads", dict(n_heads=1, n_kv_heads=1)),
                                            ("n_kv_heads", dict(n_kv_heads=1)), ("ffn_dim", dict(ffn_dim=175))])
def test_tp_refuses_a_dimension_the_world_size_does_not_divide(field, changes):
    spec = preset("tiny").with_(**changes)
    with pytest.raises(UserError, match=rf"model\.{field} = {changes[field]}.*--set model\.{field}="):
        check_strategy("tp", spec, 2)
    check_strategy("ddp", spec, 2)  # only tp splits the layers
    with pytest.raises(UserError, match=r"model\.n_kv_heads = 3"):  # base's 3 kv heads do not split in 2
        check_strategy("tp", preset("base"), 2)


def test_tp_estimate_is_four_activation_all_reduces_per_layer_and_micro_step():
    spec = preset("tiny")
    per_micro = 4 * spec.n_layers * 8 * 32 * spec.dim * 4
    assert comm_bytes_per_step_estimate("tp", spec, 2, 8, 32, 1) == per_micro
    assert comm_bytes_per_step_estimate("tp", spec, 2, 4, 32, 2) == per_micro
    assert comm_bytes_per_step_estimate("ddp", spec, 2, 4, 32, 1) == 4 * sum(
        int(np.prod(s)) for s in parameter_shapes(spec).values())
    assert comm_bytes_per_step_estimate("ddp", spec, 1, 8, 32, 1) == 0


# ---- the CLI ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, named", [(("--nproc", 1), "at least 2"),
                                          (("--nproc", 2, "--set", "model.ffn_dim=175"), "model.ffn_dim = 175"),
                                          (("--nproc", 2, "--set", "model.n_kv_heads=1"), "model.n_kv_heads = 1")])
def test_tp_that_cannot_split_exits_2_with_one_line_and_writes_nothing(extra, named, cache_dir, tmp_path):
    out = tmp_path / "never"
    proc = dpcompare("run", *FAST, "--framework", "mlx", "--set", "strategy=tp", *extra, "--steps", 2, "--out", out,
                     cache_dir=cache_dir, check=False)
    assert proc.returncode == 2
    assert named in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("sequence", ["packing", "padding"])
def test_tp_two_ranks_equal_one_ddp_rank_with_the_same_global_batch(framework, sequence, cache_dir, tmp_path):
    # grad_clip below the norms (~0.9): the clipped update depends on the global norm counting each parameter once.
    common = ("--framework", framework, "--steps", 10, "--sequence", sequence, "--eval-every", 10,
              "--set", "grad_clip=0.5")
    one = run(cache_dir, tmp_path / "ddp1", *common, "--nproc", 1)
    two = run(cache_dir, tmp_path / "tp2", *common, *TP)
    np.testing.assert_allclose(two, one, rtol=0, atol=1e-5)
    np.testing.assert_allclose(grad_norms(tmp_path / "tp2"), grad_norms(tmp_path / "ddp1"), rtol=1e-5)
    # Every tp rank holds the whole eval loss: summed over data-parallel ranks only, it is not doubled.
    np.testing.assert_allclose(eval_losses(tmp_path / "tp2"), eval_losses(tmp_path / "ddp1"), rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_tp_holds_a_share_of_the_layers_and_measures_the_estimated_communication(framework, cache_dir, tmp_path):
    out = tmp_path / "tp"
    run(cache_dir, out, "--framework", framework, "--steps", 3, "--grad-accum", 2, "--sequence", "padding", *TP)
    s = summary(out)
    spec = ModelSpec.from_dict(json.loads((out / "run_config.json").read_text())["spec"])
    shapes = parameter_shapes(spec)
    replicated = sum(int(np.prod(v)) for k, v in shapes.items() if tp_split_axis(k) is None)
    sharded = sum(int(np.prod(v)) for k, v in shapes.items() if tp_split_axis(k) is not None)
    state = s["state_bytes"]  # {"params": [per rank], "grads": [...], "optimizer": [...]}
    for params, grads, optimizer in zip(state["params"], state["grads"], state["optimizer"]):
        assert params == grads == 4 * (replicated + sharded // 2)
        assert 2 * params <= optimizer <= 2 * params + 1024
    assert s["comm_bytes_per_step"] == s["comm_bytes_per_step_estimate"] == 4 * spec.n_layers * 8 * 32 * spec.dim * 4


@pytest.mark.slow
def test_mlx_tp_and_torch_tp_agree_step_by_step(cache_dir, tmp_path):
    common = ("--steps", 20, "--lr", "1e-3", *TP)
    mlx = run(cache_dir, tmp_path / "mlx", "--framework", "mlx", *common)
    torch = run(cache_dir, tmp_path / "torch", "--framework", "torch", *common)
    np.testing.assert_allclose(mlx, torch, rtol=0, atol=1e-4)


STRATEGY = {"ddp": ("--nproc", 1), "tp": TP}


@pytest.mark.slow
@pytest.mark.parametrize("first, second, atol", [
    # mlx tp -> torch tp also loads a full checkpoint into torch TP, as torch ddp -> torch tp would
    ("mlx ddp", "mlx tp", 1e-6), ("mlx tp", "mlx ddp", 1e-6), ("torch tp", "torch ddp", 1e-6),
    ("mlx tp", "torch tp", 1e-4)])
def test_a_checkpoint_resumed_under_another_strategy_continues_the_same_curve(first, second, atol, cache_dir,
                                                                              tmp_path):
    def args(which):
        framework, strategy = which.split()
        return ("--framework", framework, *STRATEGY[strategy], "--lr-decay-steps", 20, "--lr", "1e-3")

    straight = run(cache_dir, tmp_path / "straight", *args(second), "--steps", 20)
    switched = tmp_path / "switched"
    run(cache_dir, switched, *args(first), "--steps", 10)
    resumed = run(cache_dir, switched, *args(second), "--steps", 20, "--resume")
    assert len(resumed) == 20
    np.testing.assert_allclose(resumed, straight, rtol=0, atol=atol)


class _Rank:
    """A trainer stand-in for the loop's cross-rank checks: `all_sum` adds the other rank's values."""
    world_size, rank = 2, 0

    def __init__(self, other: dict):
        self.other = other

    def all_sum(self, values, over="data"):
        assert over == "world"
        checksum = float(sum(np.abs(w).sum() for w in self.other.values()))
        return np.asarray(values) + np.array([checksum])


def test_a_checkpoint_refuses_weights_that_differ_between_ranks():
    from common.loop import TrainingError, check_replicas_agree

    weights = {"model.norm.weight": np.ones(64, dtype=np.float32)}
    check_replicas_agree(_Rank(weights), weights, step=5)
    drifted = {"model.norm.weight": np.ones(64, dtype=np.float32) * (1 + 1e-4)}
    with pytest.raises(TrainingError, match="after step 5"):
        check_replicas_agree(_Rank(drifted), weights, step=5)
