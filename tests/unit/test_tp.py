"""Tensor parallelism (--strategy tp): each layer split over the ranks, every rank reading the whole global
batch, so N tp ranks compute what one ddp rank computes; checkpoints move between strategies."""

import numpy as np
import pytest

from common.errors import UserError
from common.model.spec import preset
from common.parallel import check_strategy, comm_bytes_per_step_estimate
from common.parallel.tp import tp_shard, tp_split_axis
from common.model.weights import parameter_shapes
from helpers import FAST, dpcompare_here


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


def test_the_tp_estimate_follows_the_dtype_bf16_activations_are_half_the_bytes_gradients_stay_float32():
    spec = preset("tiny")
    fp32 = comm_bytes_per_step_estimate("tp", spec, 2, 8, 32, 1)
    # measured 262144 bytes per step on tiny in both frameworks in bf16, half of float32 (was estimated 2x)
    assert comm_bytes_per_step_estimate("tp", spec, 2, 8, 32, 1, "bfloat16") * 2 == fp32
    assert comm_bytes_per_step_estimate("ddp", spec, 2, 8, 32, 1, "bfloat16") == comm_bytes_per_step_estimate(
        "ddp", spec, 2, 8, 32, 1)  # the gradient all-reduce is float32 under the bf16 policy


# ---- checkpoints ------------------------------------------------------------------------------------------


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
    from common.train.rank_checks import TrainingError, check_replicas_agree, replica_checksum

    weights = {"model.norm.weight": np.ones(64, dtype=np.float32)}
    checksum = sum(replica_checksum(w) for w in weights.values())
    check_replicas_agree(_Rank(weights), checksum, step=5)
    drifted = {"model.norm.weight": np.ones(64, dtype=np.float32) * (1 + 1e-4)}
    with pytest.raises(TrainingError, match="after step 5"):
        check_replicas_agree(_Rank(drifted), checksum, step=5)


@pytest.mark.parametrize("extra, named", [(("--nproc", 1), "at least 2"),
                                          (("--nproc", 2, "--set", "model.ffn_dim=175"), "model.ffn_dim = 175"),
                                          (("--nproc", 2, "--set", "model.n_kv_heads=1"), "model.n_kv_heads = 1")])
def test_tp_that_cannot_split_exits_2_with_one_line_and_writes_nothing(extra, named, cache_dir, tmp_path):
    out = tmp_path / "never"
    proc = dpcompare_here("run", *FAST, "--framework", "mlx", "--set", "strategy=tp", *extra, "--steps", 2,
                          "--out", out, cache_dir=cache_dir)
    assert proc.returncode == 2
    assert named in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not out.exists()
