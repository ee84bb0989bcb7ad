"""The two checkpoint formats (common/checkpoint/store.py, common/checkpoint/sharded.py): a sharded checkpoint's
pieces assemble into any slice, read only the rank files that hold it, and load as the same state as the hf
format; a broken index is refused in one line. Runs that write them: tests/integration/test_checkpoint_formats.py."""
import json
import weakref

import numpy as np
import pytest

from common.checkpoint.store import TrainState, load_checkpoint, save_checkpoint, write_state_json
from common.config import RunConfig
from common.errors import UserError
from common.model.hfconfig import to_hf_config
from common.checkpoint.sharded import (SHARDS, ShardedSource, local_pieces, rank_file, read_index, write_index,
                                      write_rank_file, write_safetensors)
from common.checkpoint.safetensorswriter import SafetensorsWriter
from common.model.spec import preset
from common.checkpoint.tensorsource import read_all
from common.model.weights import init_weights, parameter_shapes
from helpers import dpcompare_here

RNG = np.random.default_rng(0)
FULL = {"rows": RNG.standard_normal((5, 3), dtype=np.float32),     # fsdp-like: axis 0 over 3 ranks, 2 + 2 + 1
        "cols": RNG.standard_normal((4, 6), dtype=np.float32),     # tp-like: axis 1 over 3 ranks, 2 each
        "replicated": RNG.standard_normal((7,), dtype=np.float32),  # every rank holds it: rank 0 writes it
        "stage": RNG.standard_normal((2, 2), dtype=np.float32)}    # pp-like: only rank 2 holds it
SHAPES = {name: array.shape for name, array in FULL.items()}


def write_three_ranks(directory):
    """What three ranks of mixed strategies would write: local_pieces of each rank's own arrays."""
    for rank in range(3):
        rows = -(-5 // 3)  # ceil, as FSDP2 chunks: 2, 2, 1 (rank 2's shard padded to 2 rows)
        padded = np.concatenate([FULL["rows"], np.zeros((1, 3), np.float32)])[rank * rows:(rank + 1) * rows]
        held = {"rows": padded, "cols": FULL["cols"][:, 2 * rank:2 * rank + 2], "replicated": FULL["replicated"]}
        axes = {"rows": 0, "cols": 1, "replicated": None}
        if rank == 2:
            held["stage"] = FULL["stage"]  # not in `axes`: this rank's own, whole
        state = (held, {k: v * 2 for k, v in held.items()}, {k: v * 3 for k, v in held.items()})
        *parts, where = local_pieces(rank, state, axes, SHAPES, {"rows": rank * rows})
        write_rank_file(directory, rank, tuple(parts), where)
    return write_index(directory, SHAPES, 3, {})


@pytest.fixture
def sharded(tmp_path):
    (tmp_path / SHARDS).mkdir()
    write_three_ranks(tmp_path / SHARDS)
    return tmp_path


def test_local_pieces_trims_padding_and_writes_replicated_tensors_once(sharded):
    tensors = read_index(sharded)["tensors"]
    assert [(p["file"], p["start"], p["stop"]) for p in tensors["rows"]["pieces"]] == \
        [(rank_file(0), [0, 0], [2, 3]), (rank_file(1), [2, 0], [4, 3]), (rank_file(2), [4, 0], [5, 3])]
    assert [(p["start"], p["stop"]) for p in tensors["cols"]["pieces"]] == [([0, 0], [4, 2]), ([0, 2], [4, 4]),
                                                                             ([0, 4], [4, 6])]
    assert [p["file"] for p in tensors["replicated"]["pieces"]] == [rank_file(0)]
    assert tensors["stage"]["pieces"] == [{"file": rank_file(2), "start": [0, 0], "stop": [2, 2]}]


@pytest.mark.parametrize("name, index", [
    ("rows", ()), ("rows", (slice(1, 5),)), ("rows", (slice(3, 4), slice(1, 3))), ("cols", (slice(None), slice(1, 5))),
    ("cols", (slice(2, 3),)), ("replicated", (slice(2, 6),)), ("stage", ())])
def test_any_slice_assembles_from_the_pieces_that_overlap_it(sharded, name, index):
    for kind, factor in (("weights", 1), ("exp_avg", 2), ("exp_avg_sq", 3)):
        source = ShardedSource(sharded, kind)
        got = source.read(name, index)
        np.testing.assert_array_equal(got, FULL[name][index] * factor)
        assert source.bytes_read == got.nbytes


def test_a_slice_reads_only_the_rank_files_that_hold_it(sharded):
    source = ShardedSource(sharded)  # the index is checked on opening: every file is there
    (sharded / SHARDS / rank_file(2)).unlink()
    np.testing.assert_array_equal(source.read("rows", (slice(0, 4),)), FULL["rows"][:4])  # ranks 0 and 1 only
    with pytest.raises(UserError, match="rank_00002.safetensors cannot be read"):
        source.read("rows", (slice(3, 5),))  # row 4 is rank 2's


def test_a_missing_rank_file_or_an_incomplete_index_is_refused_in_one_line(sharded):
    index = json.loads((sharded / SHARDS / "index.json").read_text())
    index["tensors"]["cols"]["pieces"].pop()
    (sharded / SHARDS / "index.json").write_text(json.dumps(index))
    with pytest.raises(UserError, match="the pieces of cols hold 16 of its 24 elements") as err:
        ShardedSource(sharded)
    assert "\n" not in str(err.value)
    (sharded / SHARDS / rank_file(1)).unlink()
    with pytest.raises(UserError, match=r"shards/rank_00001.safetensors is missing \(1 of the 3 rank files"):
        ShardedSource(sharded)


def test_the_streamed_safetensors_file_reads_back_in_safetensors(tmp_path):
    from safetensors.numpy import load_file

    write_safetensors(tmp_path / "x.safetensors", SHAPES, FULL.__getitem__, {"format": "pt"})
    back = load_file(str(tmp_path / "x.safetensors"))
    assert back.keys() == FULL.keys() and all(np.array_equal(back[k], FULL[k]) for k in FULL)


def test_tensors_written_in_any_order_read_back_and_a_missing_one_is_refused(tmp_path):
    from safetensors.numpy import load_file

    with SafetensorsWriter(tmp_path / "x.safetensors", SHAPES) as out:
        for name in reversed(list(FULL)):  # the order the ranks' gathers produce, not the header's
            out.write(name, FULL[name])
    back = load_file(str(tmp_path / "x.safetensors"))
    assert back.keys() == FULL.keys() and all(np.array_equal(back[k], FULL[k]) for k in FULL)
    with pytest.raises(ValueError, match="1 tensors never written"):
        with SafetensorsWriter(tmp_path / "y.safetensors", SHAPES) as out:
            for name in list(FULL)[1:]:
                out.write(name, FULL[name])


class _Streaming:
    """A one-rank Trainer whose export streams tensors that it forgets: weakrefs tell whether the checkpoint
    writer still holds the previous tensor when the next one is gathered."""
    framework, rank, world_size = "mlx", 0, 1

    class strategy:
        full_state_on_every_rank = True

    def __init__(self, state):
        self.state, self.alive_at_once = state, 0

    def export_state(self):
        def stream(part):
            previous = None
            for name, array in part.items():
                alive = 1 + (previous is not None and previous() is not None)
                self.alive_at_once = max(self.alive_at_once, alive)
                fresh = array.copy()  # what a gather returns: a new array the writer must let go of
                previous = weakref.ref(fresh)
                yield name, fresh
                del fresh
        return tuple(stream(part) for part in self.state)

    def all_sum(self, values, over="data"):
        return np.asarray(values, dtype=np.float64)


def test_the_hf_checkpoint_holds_one_gathered_tensor_at_a_time(tmp_path):
    """The loop writes each tensor as its gather delivers it (common/checkpoint/store.py HFCheckpointWriter), so
    the writer holds one whole tensor, not the whole state; the checkpoint loads as the state it was given."""
    from common.train.loop import checkpoint

    spec = preset("tiny")
    weights = init_weights(spec, 0)
    state = (weights, {k: v * 0.5 for k, v in weights.items()}, {k: v * v for k, v in weights.items()})
    trainer = _Streaming(state)
    checkpoint(trainer, tmp_path, spec, 3, {"seed": 0}, rank=0)
    assert trainer.alive_at_once == 1
    loaded = load_checkpoint(tmp_path / "checkpoints" / "step_000003", spec, {"seed": 0})
    for part, kind in zip(state, ("weights", "exp_avg", "exp_avg_sq")):
        assert all(np.array_equal(getattr(loaded, kind)[k], v) for k, v in part.items())


def test_non_finite_weights_leave_no_checkpoint_behind(tmp_path):
    from common.train.loop import checkpoint
    from common.train.rank_checks import TrainingError

    spec = preset("tiny")
    weights = init_weights(spec, 0)
    weights["model.norm.weight"] = np.full_like(weights["model.norm.weight"], np.nan)
    with pytest.raises(TrainingError, match="not finite after step 3"):
        checkpoint(_Streaming((weights, weights, weights)), tmp_path, spec, 3, {"seed": 0}, rank=0)
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_both_formats_load_as_the_same_state(tmp_path):
    """A tiny model's state saved whole (hf) and split over 2 ranks as fsdp splits it (sharded) loads equal,
    and the sharded load keeps its lazy sources for the Trainer."""
    spec = preset("tiny")
    weights = init_weights(spec, 0)
    exp_avg = {k: v * 0.5 for k, v in weights.items()}
    exp_avg_sq = {k: v * v for k, v in weights.items()}
    hf = save_checkpoint(tmp_path / "hf", spec, TrainState(3, weights, exp_avg, exp_avg_sq, {"seed": 0}))
    sharded = tmp_path / "sharded"
    (sharded / SHARDS).mkdir(parents=True)
    shapes = parameter_shapes(spec)
    for rank in range(2):
        held = tuple({k: np.array_split(v, 2)[rank] for k, v in part.items()} for part in (weights, exp_avg, exp_avg_sq))
        *parts, where = local_pieces(rank, held, dict.fromkeys(weights, 0), shapes)
        write_rank_file(sharded / SHARDS, rank, tuple(parts), where)
    write_index(sharded / SHARDS, shapes, 2, {})
    (sharded / "config.json").write_text(json.dumps(to_hf_config(spec)))
    write_state_json(sharded, 3, {"seed": 0})
    a, b = load_checkpoint(hf, spec, {"seed": 0}), load_checkpoint(sharded, spec, {"seed": 0})
    for kind in ("weights", "exp_avg", "exp_avg_sq"):
        x, y = getattr(a, kind), getattr(b, kind)
        assert x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)
        assert read_all(b.sources[kind]).keys() == y.keys()
    assert b.step == 3 and isinstance(b.sources["weights"], ShardedSource)


def test_an_unknown_checkpoint_format_is_refused_in_one_line(tmp_path):
    with pytest.raises(UserError, match="unknown checkpoint_format 'zip'; allowed: hf, sharded"):
        RunConfig(checkpoint_format="zip").validate()
    proc = dpcompare_here("run", "--checkpoint-format", "zip", "--out", tmp_path / "r", cache_dir=tmp_path / "cache")
    assert proc.returncode == 2 and "checkpoint_format" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
