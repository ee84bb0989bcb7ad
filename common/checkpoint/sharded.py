"""`--checkpoint-format sharded`: every rank writes what it holds, nobody gathers; read back as TensorSources.

    checkpoints/step_000010/
        config.json, state.json          as in the hf format (common/checkpoint/store.py), written by rank 0
        shards/rank_00000.safetensors    this rank's pieces: weights.<name>, exp_avg.<name>, exp_avg_sq.<name>
        shards/rank_00001.safetensors    (a rank that holds nothing of its own writes an empty file)
        shards/index.json                every HF tensor's global shape and, per piece, the rank file that
                                         holds it and its place: the block of the global tensor from
                                         "start" to "stop" (one number per dimension, stop exclusive)

What a rank writes is its strategy's `local_state` (mlx_impl/ and torch_impl/ ddp.py, fsdp.py, tp.py, pp.py,
mesh.py): fsdp its shard of each sharded tensor, tp its block of each split one, pp its stage's tensors, fsdp x
tp its rows of its tp block (for a row-parallel weight a block on two axes: rows by fsdp, columns by tp); a
tensor several ranks hold alike (ddp's, tp's replicated norms and embedding) is written once, by the first of
them. So saving costs a rank no memory beyond what it holds, and no communication beyond two barriers.

A piece is a block, a (start, stop) per dimension, because that is what any of these layouts holds and what a
reader asks for. Version 1 of the index (written before fsdp x tp could save sharded) gave each piece one
axis, {"axis", "start", "stop"}, axis null for the whole tensor; `read_index` reads it as the same blocks.

Atomic as the hf format: all ranks write into one temporary directory that rank 0 created; after a barrier
rank 0 builds the index from the rank files' headers (each file's metadata records its pieces), checks that
the pieces tile every tensor exactly, writes config.json and state.json, fsyncs, renames the directory into
place and only then moves `latest`. A kill mid-save leaves the previous checkpoint the latest.

Reading: `ShardedSource(directory, kind)` is a TensorSource (common/checkpoint/tensorsource.py) of one kind (weights or
a moment); `read(name, index)` assembles just the requested slice from the pieces that overlap it, so a rank
of any strategy and N (or the other framework) reads only what it keeps. Every rank of the job reads the
directory, so the sharded format needs a file system all ranks see (one machine, or a shared mount).
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Callable, Iterable, Mapping

import numpy as np

from common.errors import UserError
from common.fsutil import fsync_dir
from common.checkpoint.safetensorswriter import SafetensorsWriter

SHARDS, INDEX = "shards", "index.json"
SHARDED_TMP = ".tmp_step_{step:06d}_sharded"  # the checkpoint being written, under checkpoints/
KINDS = ("weights", "exp_avg", "exp_avg_sq")
FORMAT = "dpcompare-sharded"
VERSION = 2        # what this dpcompare writes: a piece is a block, start and stop per dimension
READS = (1, 2)     # version 1: a piece along one axis (the module docstring)

Box = tuple[tuple[int, int], ...]  # a piece's place in the global tensor: (start, stop) per dimension
Named = dict[str, np.ndarray]  # numpy tensors under HF names
# A strategy's local_state: (weights, exp_avg, exp_avg_sq, where) of what this rank writes
LocalState = tuple[Named, Named, Named, dict[str, Box]]


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def is_sharded(checkpoint: Path) -> bool:
    return (Path(checkpoint) / SHARDS / INDEX).is_file()


# ---- writing ------------------------------------------------------------------------------------
def write_safetensors(path: Path, shapes: dict[str, tuple], read: Callable[[str], np.ndarray],
                      metadata: dict[str, str] | None = None) -> None:
    """A float32 safetensors file written one tensor at a time, `read(name)` in the order of `shapes`."""
    with SafetensorsWriter(path, shapes, metadata=metadata) as out:
        for name in shapes:
            out.write(name, read(name))


def write_rank_file(directory: Path, rank: int, state: tuple[Named, Named, Named], where: dict[str, Box]) -> Path:
    """This rank's pieces (state: weights, exp_avg, exp_avg_sq under HF names; `where` their places)."""
    arrays = {f"{kind}.{name}": part[name] for kind, part in zip(KINDS, state) for name in where}
    path = Path(directory) / rank_file(rank)
    write_safetensors(path, {k: tuple(np.shape(v)) for k, v in arrays.items()}, arrays.__getitem__,
                      {"pieces": json.dumps({name: [list(bounds) for bounds in box] for name, box in where.items()})})
    return path


def write_index(directory: Path, shapes: dict[str, tuple], world_size: int, extra: dict) -> dict:
    """index.json from the rank files' headers (rank 0, after every rank wrote its file); checks the tiling."""
    from safetensors import safe_open

    directory = Path(directory)
    tensors = {name: {"shape": list(shape), "pieces": []} for name, shape in shapes.items()}
    for rank in range(world_size):
        with safe_open(str(directory / rank_file(rank)), framework="numpy") as handle:
            pieces = json.loads((handle.metadata() or {}).get("pieces", "{}"))
        for name, box in pieces.items():
            if name not in tensors:
                raise ValueError(f"rank {rank} wrote {name}, which this model has not")
            tensors[name]["pieces"].append({"file": rank_file(rank), "start": [start for start, _ in box],
                                            "stop": [stop for _, stop in box]})
    index = {"format": FORMAT, "version": VERSION, "world_size": world_size,
             "files": [rank_file(r) for r in range(world_size)], "tensors": tensors, **extra}
    for name, entry in tensors.items():  # a bug in a strategy's local_state shows here, not at the resume
        _check_tiling(name, entry, f"the sharded checkpoint being written in {directory}")
    (directory / INDEX).write_text(json.dumps(index, indent=1))
    return index


def save_sharded(run_dir: Path, step: int, rank: int, world_size: int, barrier: Callable[[], None],
                 local_state: LocalState, shapes: dict[str, tuple],
                 finish: Callable[[Path], Path]) -> Path | None:
    """Every rank calls it. local_state: (weights, exp_avg, exp_avg_sq, where) of this rank; `finish(tmp)`
    (rank 0) writes config.json and state.json and commits the directory (common/checkpoint/store.py's
    commit_checkpoint). Returns the checkpoint directory on rank 0."""
    root = Path(run_dir) / "checkpoints"
    tmp = root / SHARDED_TMP.format(step=step)  # one name every rank knows, without communicating
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / SHARDS).mkdir(parents=True)
    barrier()
    weights, exp_avg, exp_avg_sq, where = local_state
    write_rank_file(tmp / SHARDS, rank, (weights, exp_avg, exp_avg_sq), where)
    barrier()
    if rank != 0:
        return None
    write_index(tmp / SHARDS, shapes, world_size, {"step": step})
    fsync_dir(tmp / SHARDS)
    return finish(tmp)


def pieces_of(rank: int, named: dict, axes: dict[str, int | None], shapes: Mapping[str, tuple],
              offsets: dict[str, int] | None = None) -> dict[str, Box]:
    """Where each of this rank's tensors lies in the global one, for a strategy whose pieces lie along one axis:
    a tensor split along axes[name] starts at offsets[name] (default: rank x its local length, an even split;
    a padded last shard is cut to the global length by `trim`), and a tensor not split (axis None) that every
    rank holds whole is written by rank 0 alone (`axes` lists only the tensors every rank replicates; pp's
    stages hold disjoint tensors and give no axes). A piece that holds nothing (a padded shard past the end)
    is left out."""
    where: dict[str, Box] = {}
    for name, array in named.items():
        whole = tuple((0, size) for size in shapes[name])
        if name not in axes:
            where[name] = whole
            continue
        axis = axes[name]
        if axis is None:
            if rank == 0:
                where[name] = whole
            continue
        size = np.shape(array)[axis]
        start = (offsets or {}).get(name, rank * size)
        stop = min(start + size, shapes[name][axis])
        if stop > start:
            where[name] = whole[:axis] + ((start, stop),) + whole[axis + 1:]
    return where


def box_of(index: tuple, shape: tuple) -> Box:
    """The block a TensorSource index (a strategy's local_index: a tuple of contiguous slices, leading axes)
    selects of a tensor of `shape`, clipped to it: a padded shard's rows past the end are not in it."""
    return tuple(_bounds(index, shape))


def trim(named: dict, where: dict[str, Box]) -> dict:
    """The tensors that `where` keeps, each cut to its block's extent (a padded shard's padding, always at the
    end of an axis, dropped)."""
    out = {}
    for name, box in where.items():
        array = named[name]
        extent = tuple(stop - start for start, stop in box)
        if tuple(np.shape(array)) != extent:
            if any(held < size for held, size in zip(np.shape(array), extent)) or np.ndim(array) != len(extent):
                raise ValueError(f"{name}: the rank holds {tuple(np.shape(array))}, less than its piece {box}")
            array = array[tuple(slice(0, size) for size in extent)]
        out[name] = array
    return out


def pieces_at(state: tuple[Named, Named, Named], where: dict[str, Box]) -> LocalState:
    """(weights, exp_avg, exp_avg_sq, where) of the blocks `where` names, each cut to its extent; an empty block
    (a padded shard wholly past the end) is left out: a strategy's local_state."""
    where = {name: box for name, box in where.items() if all(stop > start for start, stop in box)}
    weights, exp_avg, exp_avg_sq = state
    return trim(weights, where), trim(exp_avg, where), trim(exp_avg_sq, where), where


def local_pieces(rank: int, state: tuple[Named, Named, Named], axes: dict, shapes: Mapping[str, tuple],
                 offsets: dict | None = None) -> LocalState:
    """(weights, exp_avg, exp_avg_sq, where) of what this rank writes, its pieces along one axis (pieces_of)."""
    return pieces_at(state, pieces_of(rank, state[0], axes, shapes, offsets))


# ---- reading ------------------------------------------------------------------------------------
def _check_tiling(name: str, entry: dict, where: str) -> None:
    """The pieces lie inside the tensor, none overlaps another, and their sizes add up to the tensor's: so they
    cover it exactly once."""
    shape = tuple(entry["shape"])
    boxes: list[tuple[list[tuple[int, int]], str]] = []
    for piece in entry["pieces"]:
        box = list(zip(piece["start"], piece["stop"]))
        if len(box) != len(shape) or not all(0 <= a < b <= size for (a, b), size in zip(box, shape)):
            raise UserError(f"{where}: {name}'s piece in {piece['file']} (from {piece['start']} to "
                            f"{piece['stop']}) lies outside its shape {shape}")
        for other, file in boxes:
            if all(a < d and c < b for (a, b), (c, d) in zip(box, other)):
                raise UserError(f"{where}: {name}'s pieces in {file} and {piece['file']} overlap")
        boxes.append((box, piece["file"]))
    total = sum(math.prod(b - a for a, b in box) for box, _ in boxes)
    if total != math.prod(shape):
        raise UserError(f"{where}: the pieces of {name} hold {total} of its {math.prod(shape)} elements; "
                        "the checkpoint is incomplete")


def _as_blocks(index: dict) -> dict:
    """A version-1 index's pieces, {"axis", "start", "stop"} along one axis (axis null: the whole tensor), as
    the blocks of version 2."""
    for entry in index["tensors"].values():
        shape = entry["shape"]
        for piece in entry["pieces"]:
            axis, start, stop = piece.pop("axis"), piece["start"], piece["stop"]
            piece["start"] = [start if d == axis else 0 for d in range(len(shape))]
            piece["stop"] = [stop if d == axis else size for d, size in enumerate(shape)]
    return index


def read_index(checkpoint: Path) -> dict:
    """The validated index of a sharded checkpoint, in version 2's form: readable, every rank file present,
    every tensor tiled."""
    shards = Path(checkpoint) / SHARDS
    try:
        index = json.loads((shards / INDEX).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"checkpoint {checkpoint}: {SHARDS}/{INDEX} is unreadable ({err})") from None
    if index.get("format") != FORMAT or index.get("version") not in READS:
        raise UserError(f"checkpoint {checkpoint}: {SHARDS}/{INDEX} is not a {FORMAT} index of version "
                        f"{' or '.join(map(str, READS))} (it says {index.get('format')!r} version "
                        f"{index.get('version')!r})")
    if index["version"] == 1:
        index = _as_blocks(index)
    missing = [f for f in index["files"] if not (shards / f).is_file()]
    if missing:
        raise UserError(f"checkpoint {checkpoint}: {SHARDS}/{missing[0]} is missing ({len(missing)} of the "
                        f"{len(index['files'])} rank files the index lists); refusing to read it")
    for name, entry in index["tensors"].items():
        _check_tiling(name, entry, f"checkpoint {checkpoint}")
    return index


def _bounds(index: tuple, shape: tuple) -> list[tuple[int, int]]:
    """(start, stop) per axis of a tuple of slices (leading axes; the rest whole)."""
    out = []
    for axis, size in enumerate(shape):
        part = index[axis] if axis < len(index) else slice(None)
        if not isinstance(part, slice) or part.step not in (None, 1):
            raise ValueError(f"a TensorSource index is a tuple of contiguous slices, got {index!r}")
        start, stop, _ = part.indices(size)
        out.append((start, max(start, stop)))
    return out


class ShardedSource:
    """One kind (weights, exp_avg or exp_avg_sq) of a sharded checkpoint as a TensorSource: a slice is
    assembled from the rank files' pieces that overlap it, each read with safetensors' get_slice."""

    def __init__(self, checkpoint: Path, kind: str = "weights", index: dict | None = None):
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        self.checkpoint, self.kind, self.bytes_read = Path(checkpoint), kind, 0
        self.index = index if index is not None else read_index(self.checkpoint)
        self._files: dict = {}

    def names(self) -> list[str]:
        return list(self.index["tensors"])

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.index["tensors"][name]["shape"])

    def _file(self, name: str):
        from safetensors import SafetensorError, safe_open

        if name not in self._files:
            path = self.checkpoint / SHARDS / name
            try:
                self._files[name] = safe_open(str(path), framework="numpy")
            except (SafetensorError, OSError, ValueError) as err:
                raise UserError(f"{path} cannot be read (truncated or corrupt?): {err}") from None
        return self._files[name]

    def read(self, name: str, index: tuple = ()) -> np.ndarray:
        shape = self.shape(name)
        box = _bounds(index, shape)
        out = np.empty([stop - start for start, stop in box], dtype=np.float32)
        covered = 0
        for piece in self.index["tensors"][name]["pieces"]:
            origin = piece["start"]
            lo = [max(b[0], o) for b, o in zip(box, origin)]
            hi = [min(b[1], e) for b, e in zip(box, piece["stop"])]
            if any(a >= b for a, b in zip(lo, hi)):
                continue
            src = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, origin))
            dst = tuple(slice(a - b0[0], b - b0[0]) for a, b, b0 in zip(lo, hi, box))
            part = self._file(piece["file"]).get_slice(f"{self.kind}.{name}")
            out[dst] = part[src] if src else part[:]
            covered += math.prod(b - a for a, b in zip(lo, hi))
        if covered != out.size:
            raise UserError(f"checkpoint {self.checkpoint}: the pieces of {name} cover {covered} of the "
                            f"{out.size} elements asked for")
        self.bytes_read += out.nbytes
        return out


def sharded_sources(checkpoint: Path) -> dict[str, ShardedSource]:
    """{"weights", "exp_avg", "exp_avg_sq"}: the checkpoint's three TensorSources, sharing one index."""
    index = read_index(checkpoint)
    return {kind: ShardedSource(checkpoint, kind, index) for kind in KINDS}


def shapes_only(source, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """Zero-byte stand-ins (broadcast views) with each tensor's shape, for checks that read only shapes."""
    return {n: np.broadcast_to(np.float32(0), source.shape(n)) for n in (names or source.names())}
