"""A training step's state written as a checkpoint, in the run's format (`--checkpoint-format`): whole HF files that
rank 0 writes as the state streams by (`checkpoint`), or every rank its own pieces (`checkpoint_sharded`). The loop
(common/train/loop.py) calls CHECKPOINT_WRITERS[format] every --checkpoint-every steps and at the end."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from common.checkpoint.sharded import SHARDED_TMP, save_sharded
from common.checkpoint.store import STATE_KINDS, HFCheckpointWriter, commit_checkpoint, write_state_json
from common.model.hfconfig import to_hf_config
from common.model.spec import ModelSpec
from common.model.weights import parameter_shapes
from common.train.rank_checks import TrainingError, check_replicas_agree, replica_checksum


def checkpoint(trainer, run_dir: Path, spec: ModelSpec, step: int, fingerprints: dict, rank: int,
               shapes: dict[str, tuple[int, ...]] | None = None) -> None:
    """The hf format: the strategy's export streams the whole state one tensor at a time (gathered by
    collectives every rank takes part in, in one order) and rank 0, the one writer, writes each tensor as it
    arrives, so no rank holds more than one whole tensor beyond its own state. Non-finite weights or drifted
    replicas stop every rank before the checkpoint is committed; the last one is kept. `shapes`: the state's
    tensors (the spec's parameters, or a LoRA run's adapters: common/model/lora.py)."""
    out = HFCheckpointWriter(run_dir, spec, step, shapes) if rank == 0 else None
    try:
        finite, checksum = True, 0.0
        for kind, stream in zip(STATE_KINDS, trainer.export_state()):
            for name, array in stream:
                if array is None:  # fsdp: the gathered tensor lands on rank 0 only
                    continue
                if kind == "weights":
                    finite = finite and bool(np.isfinite(array).all())
                    checksum += replica_checksum(array)
                if out is not None:
                    out.write(kind, name, array)
                del array  # before the next gather
        if trainer.all_sum(np.array([float(not finite)]), over="world")[0] > 0:  # every rank stops, or none
            raise TrainingError(f"weights are not finite after step {step}; not saving (the last checkpoint is kept)")
        if trainer.strategy.full_state_on_every_rank:  # fsdp: only rank 0 holds the gathered weights
            check_replicas_agree(trainer, checksum, step)
    except BaseException:
        if out is not None:
            out.abort()
        raise
    if out is not None:
        out.commit({**fingerprints, "framework": trainer.framework})


def checkpoint_sharded(trainer, run_dir: Path, spec: ModelSpec, step: int, fingerprints: dict, rank: int,
                       shapes: dict[str, tuple[int, ...]] | None = None) -> None:
    """--checkpoint-format sharded: every rank writes its own pieces (common/checkpoint/sharded.py), nothing is
    gathered. Replicas are not compared (ddp's are written once, by rank 0)."""
    local = trainer.local_state()
    finite = all(np.isfinite(w).all() for w in local[0].values())
    if trainer.all_sum(np.array([float(not finite)]), over="world")[0] > 0:  # every rank stops, or none
        raise TrainingError(f"weights are not finite after step {step}; not saving (the last checkpoint is kept)")

    def finish(tmp: Path) -> Path:  # rank 0, once every rank wrote its file
        (tmp / "config.json").write_text(json.dumps(to_hf_config(spec), indent=2))
        write_state_json(tmp, step, {**fingerprints, "framework": trainer.framework, "checkpoint_format": "sharded"})
        return commit_checkpoint(tmp.parent, tmp, step)

    try:
        save_sharded(run_dir, step, rank, trainer.world_size, lambda: trainer.all_sum(np.zeros(1), over="world"),
                     local, parameter_shapes(spec) if shapes is None else shapes, finish)
    except BaseException:  # no partial step directory is left, and a full disk gets its room back
        shutil.rmtree(run_dir / "checkpoints" / SHARDED_TMP.format(step=step), ignore_errors=True)
        raise


CHECKPOINT_WRITERS = {"hf": checkpoint, "sharded": checkpoint_sharded}  # RunConfig.checkpoint_format
