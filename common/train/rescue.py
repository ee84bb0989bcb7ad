"""A ddp rank's last completed step, kept so that a survivor can save it when a peer is lost.

Under ddp every rank holds the whole training state. When a rank dies, hangs or fails and the job has
restarts left (--max-restarts, compare/launch/restarts.py), the launcher writes ranks/rescue.json naming
the lowest surviving rank before it stops the job; that rank's rescue thread saves its last completed
step as a checkpoint, with no collective (a peer is gone), and answers in ranks/rescued.json. The
restart then resumes from that step: no step is recomputed.

Why a copy of the state and not the live one: the step that failed may have changed it half-way (MLX:
the weights are lazy arrays that depend on the lost all-reduce and can never be evaluated; torch: a
failure between the optimizer update and the loss all-reduce). The copy is taken after each completed
step, under a lock the rescue thread takes too. torch updates its tensors in place, so its ranks copy the weights
and both AdamW moments after every step (3x the parameters' bytes, and a memcpy); MLX arrays never change, so
its ranks keep the step's arrays themselves (no copy; the memory of one step's state is freed a step later).
It is kept only under ddp with --max-restarts.

Why a thread: a survivor is either blocked in a collective that never returns (a stopped peer, the MLX
ring) or has raised a peer error (gloo, the ring on a closed socket). Both frameworks release the GIL
while they wait, so the thread runs in either case (measured here: MLX ring and torch gloo). A rank
whose step raised lingers in `linger` until the launcher has asked, or has stopped the job.
"""
from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np

from common.metrics import read_json, write_json

REQUEST_FILE = "rescue.json"   # in ranks/, from the launcher: {"rank": R} (None: nobody saves)
DONE_FILE = "rescued.json"     # in ranks/, from the saving rank: {"rank", "step", "row", "seconds"} or an error
POLL_S = 0.1
LINGER_S = 60.0                # a rank whose step raised waits this long for the launcher at most

State = tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]]
Saver = Callable[[int, State], Path]


def copy_state(streams, copy: bool = True) -> State:
    """export_state's three streams (ddp: numpy views of the live tensors) kept: as owned copies, or (`copy`
    False, Trainer.state_is_immutable: MLX) as the views themselves, which hold arrays that never change."""
    weights, exp_avg, exp_avg_sq = ({name: np.array(array, dtype=np.float32, copy=True if copy else None)
                                     for name, array in stream}
                                    for stream in streams)
    return weights, exp_avg, exp_avg_sq


class Rescue:
    """This rank's last completed step and the thread that saves it when the launcher asks."""

    def __init__(self, run_dir: Path, rank: int, save: Saver):
        self.ranks_dir, self.rank, self.save = Path(run_dir) / "ranks", rank, save
        self.lock = threading.Lock()
        self.step: int | None = None
        self.state: State | None = None
        self.row: dict | None = None
        self.handled = threading.Event()   # the launcher's request was seen (and, if it named this rank, done)
        threading.Thread(target=self._watch, name="rescue-watch", daemon=True).start()

    def keep(self, step: int, state: State, row: dict) -> None:
        """After step `step` completed: its state (owned copies) and its metrics row."""
        with self.lock:
            self.step, self.state, self.row = step, state, row

    def linger(self, timeout_s: float = LINGER_S) -> None:
        """Wait until the launcher's request was handled, or `timeout_s`; the launcher stops the job after."""
        self.handled.wait(timeout_s)

    def _watch(self) -> None:
        request_path = self.ranks_dir / REQUEST_FILE
        while (request := read_json(request_path)) is None:
            time.sleep(POLL_S)
        if request.get("rank") == self.rank:
            self._save()
        self.handled.set()

    def _save(self) -> None:
        started = time.time()
        with self.lock:
            step, state, row = self.step, self.state, self.row
            try:
                if step is None or state is None:
                    answer: dict = {"rank": self.rank, "step": None, "error": "no step completed yet"}
                else:
                    path = self.save(step, state)
                    answer = {"rank": self.rank, "step": step, "row": row, "checkpoint": path.name,
                              "seconds": time.time() - started}
            except Exception as err:  # noqa: BLE001 - the launcher falls back to the last checkpoint
                answer = {"rank": self.rank, "step": None, "error": f"{type(err).__name__}: {err}"}
        try:
            write_json(self.ranks_dir / DONE_FILE, answer)
        except OSError:
            pass  # a full disk: the launcher times out and falls back


def request(run_dir: Path, rank: int | None) -> None:
    """The launcher: ask `rank` to save its last completed step (None: release every lingering rank)."""
    write_json(Path(run_dir) / "ranks" / REQUEST_FILE, {"rank": rank, "time": time.time()})


def answer(run_dir: Path) -> dict | None:
    """The saving rank's answer, once written."""
    return read_json(Path(run_dir) / "ranks" / DONE_FILE)


def saver(run_dir: Path, spec, info: dict, checkpoint_format: str, shapes: dict | None = None) -> Saver:
    """Save a kept step in the run's checkpoint format, as one writer (no collective): hf files, or a
    sharded checkpoint of one rank file holding every tensor whole (ddp's sharded layout from rank 0)."""
    from common.checkpoint.sharded import SHARDS, local_pieces, write_index, write_rank_file
    from common.checkpoint.store import HFCheckpointWriter, STATE_KINDS, commit_checkpoint, write_state_json
    from common.fsutil import fsync_dir
    from common.model.hfconfig import to_hf_config
    from common.model.weights import parameter_shapes

    def save_hf(step: int, state: State) -> Path:
        out = HFCheckpointWriter(run_dir, spec, step, shapes)
        try:
            for kind, part in zip(STATE_KINDS, state):
                for name, array in part.items():
                    out.write(kind, name, array)
            return out.commit(info)
        except BaseException:
            out.abort()
            raise

    def save_sharded(step: int, state: State) -> Path:
        root = Path(run_dir) / "checkpoints"
        tmp = root / f".tmp_step_{step:06d}_rescue"
        state_shapes = parameter_shapes(spec) if shapes is None else shapes
        try:
            (tmp / SHARDS).mkdir(parents=True, exist_ok=True)
            *pieces, where = local_pieces(0, state, dict.fromkeys(state[0]), state_shapes)
            write_rank_file(tmp / SHARDS, 0, (pieces[0], pieces[1], pieces[2]), where)
            write_index(tmp / SHARDS, state_shapes, 1, {"step": step})
            fsync_dir(tmp / SHARDS)
            (tmp / "config.json").write_text(json.dumps(to_hf_config(spec), indent=2))
            write_state_json(tmp, step, {**info, "checkpoint_format": "sharded"})
            return commit_checkpoint(root, tmp, step)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    return save_sharded if checkpoint_format == "sharded" else save_hf
