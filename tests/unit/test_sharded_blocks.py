"""--checkpoint-format sharded under fsdp x tp: a piece is a block on any axes (common/checkpoint/sharded.py). Each
rank of an fsdp=2 x tp=2 mesh writes what it holds in both frameworks (a row-parallel weight: fsdp's rows of tp's
columns, on two axes), the pieces tile every tensor once, and any layout re-slices its part from them, or they
theirs from any one-axis layout's; an index of version 1 (a piece along one axis) still reads. No training
process: the ranks are simulated one after another. The run that hands such a checkpoint across meshes and
frameworks is tests/integration/test_mesh.py's."""
import json
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from common.checkpoint.sharded import (SHARDS, ShardedSource, local_pieces, rank_file, write_index, write_rank_file,
                                      write_safetensors)
from common.checkpoint.tensorsource import DictSource
from common.config import RunConfig
from common.errors import UserError
from common.model.spec import preset
from common.model.weights import init_weights, parameter_shapes
from common.parallel.fsdp import fsdp_rows
from common.parallel.mesh import Mesh
from common.parallel.tp import tp_index, tp_split_axis

SPEC = replace(preset("tiny"), vocab_size=511)  # an uneven vocabulary: MLX pads its last fsdp shard with a zero row
SEED = init_weights(SPEC, 0)
SHAPES = parameter_shapes(SPEC)
MESH = Mesh.parse("fsdp=2,tp=2")  # tp innermost: rank r is fsdp r // 2, tp r % 2
D, F = SPEC.dim, SPEC.ffn_dim
FACTORS = {"weights": 1, "exp_avg": 2, "exp_avg_sq": 3}  # the moments told apart from the weights


class _Group:
    """A group that only answers its rank and size: wrapping a model asks nothing more of it."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


def mlx_rank(rank: int, source):
    """MLX's ShardedTensorParallel as rank `rank` of the mesh builds it, its model wrapped and loaded from
    `source` -> (the strategy, the rank's parameters under their paths)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlx_impl.comm import CommCounter
    from mlx_impl.mesh import ShardedTensorParallel
    from mlx_impl.model import Llama

    axes = {name: SimpleNamespace(group=_Group(MESH.coordinate(rank, name), 2)) for name in ("fsdp", "tp")}
    strategy = ShardedTensorParallel(SimpleNamespace(resolved_backend="mpi", all_reduce_size_mb=25),
                                     SimpleNamespace(axes=axes), CommCounter())
    held = dict(tree_flatten(strategy.wrap(Llama(SPEC), source).parameters()))
    mx.eval(held)
    return strategy, held


def mlx_local_state(rank: int):
    strategy, held = mlx_rank(rank, DictSource(SEED))
    return strategy.local_state(SHAPES, *({k: v * f for k, v in held.items()} for f in FACTORS.values()))


def torch_local_state(rank: int):
    """torch's ShardedTensorParallel.local_state of what rank `rank` holds: the block its local_index names of each
    tensor (what FSDP2 over DTensor tp keeps, which the integration runs load and check shape by shape)."""
    import torch

    from torch_impl.mesh import ShardedTensorParallel

    strategy = ShardedTensorParallel.__new__(ShardedTensorParallel)  # its placement only: no process group
    strategy.tp = SimpleNamespace(rank=MESH.coordinate(rank, "tp"), size=2)
    strategy.rank, strategy.size = MESH.coordinate(rank, "fsdp"), 2
    held = {name: torch.from_numpy(np.ascontiguousarray(SEED[name][strategy.local_index(name, shape)]))
            for name, shape in SHAPES.items()}
    return strategy.local_state(SHAPES, *({k: v * f for k, v in held.items()} for f in FACTORS.values()))


def write_checkpoint(directory, local_states) -> dict:
    """Each rank's local_state into its rank file, then rank 0's index (which checks the tiling)."""
    (directory / SHARDS).mkdir(parents=True)
    for rank, (weights, exp_avg, exp_avg_sq, where) in enumerate(local_states):
        write_rank_file(directory / SHARDS, rank, (weights, exp_avg, exp_avg_sq), where)
    return write_index(directory / SHARDS, SHAPES, len(local_states), {})


def places(index: dict, name: str) -> list:
    return [(p["file"], p["start"], p["stop"]) for p in index["tensors"][name]["pieces"]]


@pytest.fixture(scope="module", params=["mlx", "torch"])
def fsdp_x_tp(request, tmp_path_factory):
    """(framework, directory, index) of a checkpoint the 4 ranks of fsdp=2 x tp=2 wrote."""
    local_state = {"mlx": mlx_local_state, "torch": torch_local_state}[request.param]
    directory = tmp_path_factory.mktemp(f"fsdp2xtp2-{request.param}")
    return request.param, directory, write_checkpoint(directory, [local_state(rank) for rank in range(4)])


def test_fsdp_x_tp_ranks_write_their_blocks_once_and_they_read_back_whole(fsdp_x_tp):
    framework, directory, index = fsdp_x_tp
    # a row-parallel weight: fsdp's rows (axis 0) of tp's columns (axis 1), a block on two axes per rank
    half = D // 2
    assert places(index, "model.layers.0.self_attn.o_proj.weight") == [
        (rank_file(0), [0, 0], [half, half]), (rank_file(1), [0, half], [half, D]),
        (rank_file(2), [half, 0], [D, half]), (rank_file(3), [half, half], [D, D])]
    assert places(index, "model.layers.1.mlp.down_proj.weight") == [
        (rank_file(0), [0, 0], [half, F // 2]), (rank_file(1), [0, F // 2], [half, F]),
        (rank_file(2), [half, 0], [D, F // 2]), (rank_file(3), [half, F // 2], [D, F])]
    # a column-parallel one: fsdp's half of tp's half of the rows
    assert [p[1][0] for p in places(index, "model.layers.0.mlp.gate_proj.weight")] == [0, F // 2, F // 4, 3 * F // 4]
    # tp replicates the embedding: tp rank 0 of each fsdp rank writes it, its padded row (MLX) cut
    assert places(index, "model.embed_tokens.weight") == [(rank_file(0), [0, 0], [256, D]),
                                                          (rank_file(2), [256, 0], [511, D])]
    # the final norm: MLX keeps it whole on every rank (rank 0 writes it), FSDP2 shards it over fsdp
    assert places(index, "model.norm.weight") == ([(rank_file(0), [0], [D])] if framework == "mlx" else
                                                  [(rank_file(0), [0], [half]), (rank_file(2), [half], [D])])
    for kind, factor in FACTORS.items():
        source = ShardedSource(directory, kind)
        for name in SHAPES:
            np.testing.assert_allclose(source.read(name), SEED[name] * factor, rtol=1e-6, err_msg=name)


@pytest.mark.parametrize("layout", ["tp=2", "fsdp=3", "boxes across the pieces"])
def test_any_layout_re_slices_its_part_from_the_fsdp_x_tp_blocks(fsdp_x_tp, layout):
    _, directory, _ = fsdp_x_tp
    source = ShardedSource(directory, "exp_avg")
    for name, shape in SHAPES.items():
        if layout == "tp=2":
            wanted = [tp_index(name, shape, rank, 2) for rank in range(2)]
        elif layout == "fsdp=3":  # uneven: 171, 171 and 169 rows of the vocabulary
            wanted = [(fsdp_rows(shape[0], rank, 3),) for rank in range(3)]
        else:  # blocks that cut across the pieces on every axis
            wanted = [tuple(slice(size // 3, size - size // 5) for size in shape)]
        for index in wanted:
            np.testing.assert_allclose(source.read(name, index), SEED[name][index] * 2, rtol=1e-6, err_msg=name)


@pytest.mark.parametrize("writer", ["tp=2", "fsdp=3"])
def test_mlx_fsdp_x_tp_ranks_resume_from_a_one_axis_layouts_pieces(tmp_path, writer):
    """The other way: a checkpoint tp or an uneven fsdp wrote, read by each fsdp x tp rank as it wraps its model."""
    ranks = 2 if writer == "tp=2" else 3
    states = []
    for rank in range(ranks):
        if writer == "tp=2":
            index = {name: tp_index(name, shape, rank, 2) for name, shape in SHAPES.items()}
            axes = {name: tp_split_axis(name) for name in SHAPES}
        else:
            index = {name: (fsdp_rows(shape[0], rank, 3),) for name, shape in SHAPES.items()}
            axes = dict.fromkeys(SHAPES, 0)
        held = {name: SEED[name][index[name]] for name in SHAPES}
        offsets = {name: index[name][0].start for name in SHAPES} if writer == "fsdp=3" else None
        states.append(local_pieces(rank, (held, held, held), axes, SHAPES, offsets))
    write_checkpoint(tmp_path, states)
    for rank in range(4):
        strategy, held = mlx_rank(rank, ShardedSource(tmp_path, "weights"))
        for path, value in held.items():
            name = path.replace(".module.", ".")
            expected = SEED[name][strategy.local_index(name, SHAPES[name])]
            got = np.array(value)[:expected.shape[0]]  # past it: the padded vocabulary's zero row
            np.testing.assert_array_equal(got, expected, err_msg=name)
            assert not np.array(value)[expected.shape[0]:].any()


def test_an_index_of_version_1_still_reads(tmp_path):
    """Written before pieces were blocks: {"axis", "start", "stop"} along one axis, axis null for the whole tensor."""
    rows, whole = np.arange(15, dtype=np.float32).reshape(5, 3), np.arange(4, dtype=np.float32)
    shards = tmp_path / SHARDS
    shards.mkdir()
    for rank, part in ((0, {"weights.rows": rows[:2], "weights.whole": whole}), (1, {"weights.rows": rows[2:]})):
        write_safetensors(shards / rank_file(rank), {k: v.shape for k, v in part.items()}, part.__getitem__)
    (shards / "index.json").write_text(json.dumps({
        "format": "dpcompare-sharded", "version": 1, "world_size": 2, "files": [rank_file(0), rank_file(1)],
        "step": 3, "tensors": {
            "rows": {"shape": [5, 3], "pieces": [{"file": rank_file(0), "axis": 0, "start": 0, "stop": 2},
                                                 {"file": rank_file(1), "axis": 0, "start": 2, "stop": 5}]},
            "whole": {"shape": [4], "pieces": [{"file": rank_file(0), "axis": None, "start": None, "stop": None}]}}}))
    source = ShardedSource(tmp_path)
    np.testing.assert_array_equal(source.read("rows", (slice(1, 4), slice(1, 3))), rows[1:4, 1:3])
    np.testing.assert_array_equal(source.read("whole"), whole)
    assert places(source.index, "rows") == [(rank_file(0), [0, 0], [2, 3]), (rank_file(1), [2, 0], [5, 3])]


def test_pieces_that_overlap_are_refused_even_where_their_sizes_add_up(fsdp_x_tp, tmp_path):
    _, directory, _ = fsdp_x_tp
    import shutil

    shutil.copytree(directory, tmp_path / "ckpt")
    path = tmp_path / "ckpt" / SHARDS / "index.json"
    index = json.loads(path.read_text())
    pieces = index["tensors"]["model.layers.0.self_attn.o_proj.weight"]["pieces"]
    pieces[1]["start"][1], pieces[1]["stop"][1] = 8, D // 2 + 8  # over rank 0's block, the same size
    path.write_text(json.dumps(index))
    with pytest.raises(UserError, match="o_proj.weight's pieces in rank_00000.safetensors and rank_00001.safetensors "
                                        "overlap") as err:
        ShardedSource(tmp_path / "ckpt")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("framework", ["mlx", "torch"])
def test_fsdp_x_tp_takes_the_sharded_format(framework):
    cfg = RunConfig.from_dict({"preset": "tiny", "nproc": 4, "mesh": "fsdp=2,tp=2", "framework": framework,
                               "checkpoint_format": "sharded"})
    assert (cfg.strategy, cfg.checkpoint_format) == ("mesh", "sharded")
