"""Checkpoint format shared by both backends, so a run can switch framework at a checkpoint.

    checkpoints/step_000010/
        config.json             HF Llama config (the model spec)
        model.safetensors       weights under HF names (loads in transformers too)
        optimizer.safetensors   AdamW moments: exp_avg.<param name>, exp_avg_sq.<param name>
        state.json              step, optimizer step count, sampler position, data and tokenizer
                                fingerprints, framework that wrote it
    checkpoints/latest          name of the newest complete checkpoint directory

A checkpoint is written into a temporary directory, fsynced, then renamed into place, and only then
does `latest` move: a kill mid-save leaves the previous checkpoint as the latest loadable one.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .errors import UserError
from .fsutil import atomic_write_text, fsync_dir
from .spec import ModelSpec
from .tensorsource import SafetensorsSource, TensorSource, check_source, open_pretrained, read_all
from .weights import save_pretrained

if TYPE_CHECKING:
    from .config import RunConfig

FORMAT_VERSION = 1
KEEP_LAST = 2


@dataclass
class TrainState:
    step: int                        # completed optimizer steps
    weights: dict[str, np.ndarray]
    exp_avg: dict[str, np.ndarray]
    exp_avg_sq: dict[str, np.ndarray]
    info: dict                       # sampler, fingerprints, framework


def resume_fingerprints(cfg: RunConfig, cache_meta: dict, token_cache: str) -> dict:
    """What a checkpoint must share with the run that resumes it, or the batches would differ."""
    return {"data_fingerprint": cache_meta.get("fingerprint", str(token_cache)),
            "global_batch_size": cfg.global_batch_size, "seed": cfg.seed, "seq_len": cfg.seq_len,
            "sequence": cfg.sequence}


def save_checkpoint(run_dir: Path, spec: ModelSpec, state: TrainState) -> Path:
    from safetensors.numpy import save_file

    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{state.step:06d}"
    tmp = root / f".tmp_step_{state.step:06d}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    save_pretrained(tmp, spec, state.weights)
    moments = {f"exp_avg.{k}": v for k, v in state.exp_avg.items()}
    moments.update({f"exp_avg_sq.{k}": v for k, v in state.exp_avg_sq.items()})
    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in moments.items()},
              str(tmp / "optimizer.safetensors"))
    meta = {"format_version": FORMAT_VERSION, "step": state.step, **state.info}
    (tmp / "state.json").write_text(json.dumps(meta, indent=2))
    for f in tmp.iterdir():
        with open(f, "rb") as handle:
            os.fsync(handle.fileno())
    fsync_dir(tmp)
    if final.exists():  # re-saving the same step (e.g. after a resume): replace it whole
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(root)
    atomic_write_text(root / "latest", final.name + "\n")
    _prune(root, keep=final.name)
    return final


def _prune(root: Path, keep: str) -> None:
    done = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in done[:-KEEP_LAST]:
        if old.name != keep:
            shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(run_dir: Path) -> Path | None:
    root = Path(run_dir) / "checkpoints"
    pointer = root / "latest"
    if pointer.exists():
        candidate = root / pointer.read_text().strip()
        if candidate.is_dir():
            return candidate
    done = sorted(p for p in root.glob("step_*") if p.is_dir()) if root.exists() else []
    return done[-1] if done else None


@dataclass
class CheckpointSources:
    """A checkpoint opened for reading slice by slice (common/tensorsource.py): what a resuming rank reads
    its part of the weights and moments from, without ever loading the whole."""
    step: int
    weights: TensorSource
    exp_avg: TensorSource
    exp_avg_sq: TensorSource
    info: dict


def open_checkpoint(path: Path, spec: ModelSpec, expect: dict) -> CheckpointSources:
    """Validate (state.json, fingerprints in `expect`, the spec, every tensor's name and shape from the
    files' headers) and open the tensors lazily; nothing is read yet."""
    path = Path(path)
    state_path = path / "state.json"
    try:
        meta = json.loads(state_path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"checkpoint {path} has no readable state.json ({err}); refusing to resume") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise UserError(f"checkpoint {path} has format version {meta.get('format_version')}, "
                        f"this dpcompare reads {FORMAT_VERSION}")
    saved_spec, weights = open_pretrained(path)
    if saved_spec != spec:
        diff = [k for k, v in spec.to_dict().items() if saved_spec.to_dict()[k] != v]
        raise UserError(f"checkpoint {path} was written for another model spec "
                        f"({', '.join(f'{k}={saved_spec.to_dict()[k]}' for k in diff)}); refusing to resume")
    for key, value in expect.items():
        if meta.get(key) != value:
            raise UserError(f"checkpoint {path}: {key} is {meta.get(key)!r}, this run has {value!r}; "
                            "refusing to resume")
    if not (path / "optimizer.safetensors").is_file():
        raise UserError(f"checkpoint {path}: optimizer.safetensors not found")
    moments = {}
    for prefix in ("exp_avg.", "exp_avg_sq."):
        moments[prefix] = SafetensorsSource(path / "optimizer.safetensors", prefix=prefix)
        check_source(spec, moments[prefix], f"{path}/optimizer.safetensors ({prefix[:-1]})")
    return CheckpointSources(step=int(meta["step"]), weights=weights, exp_avg=moments["exp_avg."],
                             exp_avg_sq=moments["exp_avg_sq."], info=meta)


def load_checkpoint(path: Path, spec: ModelSpec, expect: dict) -> TrainState:
    """Load and validate; `expect` holds fingerprints that must match (tokenizer, data, batch)."""
    opened = open_checkpoint(path, spec, expect)
    return TrainState(step=opened.step, weights=read_all(opened.weights), exp_avg=read_all(opened.exp_avg),
                      exp_avg_sq=read_all(opened.exp_avg_sq), info=opened.info)
