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
from typing import TYPE_CHECKING, Mapping

import numpy as np

from common.errors import UserError
from common.fsutil import atomic_write_text, fsync_dir
from common.model.hfconfig import to_hf_config
from common.checkpoint.safetensorswriter import SafetensorsWriter
from common.checkpoint.sharded import INDEX, is_sharded, sharded_sources
from common.model.spec import ModelSpec
from common.checkpoint.tensorsource import SafetensorsSource, TensorSource, check_source, read_all
from common.model.weights import parameter_shapes

if TYPE_CHECKING:
    from common.config import RunConfig

FORMAT_VERSION = 1
KEEP_LAST = 2


@dataclass
class TrainState:
    step: int                        # completed optimizer steps
    weights: dict[str, np.ndarray]
    exp_avg: dict[str, np.ndarray]
    exp_avg_sq: dict[str, np.ndarray]
    info: dict                       # sampler, fingerprints, framework
    sources: dict | None = None      # {"weights", "exp_avg", "exp_avg_sq"}: TensorSources of the checkpoint read


def resume_fingerprints(cfg: RunConfig, cache_meta: dict, token_cache: str) -> dict:
    """What a checkpoint must share with the run that resumes it, or the batches would differ."""
    found = {"data_fingerprint": cache_meta.get("fingerprint", str(token_cache)),
             "global_batch_size": cfg.global_batch_size, "seed": cfg.seed, "seq_len": cfg.seq_len,
             "sequence": cfg.sequence}
    # a recipe's data choices away from dpcompare's (a run of the defaults carries no such key, as before recipes)
    found.update({k: getattr(cfg, k) for k, default in (("data_order", "dpcompare"), ("mask_convention", "exact"))
                  if getattr(cfg, k) != default})
    adapters = cfg.trained.describe()  # LoRA: the same adapters (a full run's checkpoints carry no such key)
    return {**found, "adapters": adapters} if adapters else found


def save_checkpoint(run_dir: Path, spec: ModelSpec, state: TrainState) -> Path:
    """The hf format from whole dicts (tests, tools); the loop streams instead (HFCheckpointWriter)."""
    out = HFCheckpointWriter(run_dir, spec, state.step)
    for kind, part in zip(STATE_KINDS, (state.weights, state.exp_avg, state.exp_avg_sq)):
        for name, array in part.items():
            out.write(kind, name, array)
    return out.commit(state.info)


STATE_KINDS = ("weights", "exp_avg", "exp_avg_sq")


class HFCheckpointWriter:
    """The hf format written as the state arrives, one tensor at a time (common/checkpoint/safetensorswriter.py): the
    files' headers come from the spec, so the writer (rank 0) never holds more than the tensor in hand, where
    safetensors' save_file would want the whole state (weights and both moments) at once. Everything goes
    into a temporary directory that `commit` renames into place; `abort` removes it."""

    def __init__(self, run_dir: Path, spec: ModelSpec, step: int, shapes: dict[str, tuple[int, ...]] | None = None):
        """`shapes`: the state's tensors (default: the spec's parameters; a LoRA run's adapters)."""
        self.spec, self.step = spec, step
        self.root = Path(run_dir) / "checkpoints"
        self.root.mkdir(parents=True, exist_ok=True)
        self.tmp = self.root / f".tmp_step_{step:06d}_{os.getpid()}"
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir()
        shapes = parameter_shapes(spec) if shapes is None else shapes
        moments = {f"{kind}.{name}": shape for kind in STATE_KINDS[1:] for name, shape in shapes.items()}
        self.files = {"weights": SafetensorsWriter(self.tmp / "model.safetensors", shapes, metadata={"format": "pt"}),
                      "optimizer": SafetensorsWriter(self.tmp / "optimizer.safetensors", moments)}

    def write(self, kind: str, name: str, array: np.ndarray) -> None:
        """kind: "weights", "exp_avg" or "exp_avg_sq"; name: the HF parameter name."""
        if kind == "weights":
            self.files["weights"].write(name, array)
        else:
            self.files["optimizer"].write(f"{kind}.{name}", array)

    def commit(self, info: dict) -> Path:
        for handle in self.files.values():
            handle.close()
        (self.tmp / "config.json").write_text(json.dumps(to_hf_config(self.spec), indent=2))
        write_state_json(self.tmp, self.step, info)
        return commit_checkpoint(self.root, self.tmp, self.step)

    def abort(self) -> None:
        for handle in self.files.values():
            handle.file.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def write_state_json(directory: Path, step: int, info: dict) -> None:
    meta = {"format_version": FORMAT_VERSION, "step": step, **info}
    (Path(directory) / "state.json").write_text(json.dumps(meta, indent=2))


def commit_checkpoint(root: Path, tmp: Path, step: int, keep_last: int = KEEP_LAST) -> Path:
    """fsync the files of a complete temporary checkpoint, rename it into place, then move `latest`."""
    final = root / f"step_{step:06d}"
    for f in tmp.iterdir():
        if f.is_file():
            with open(f, "rb") as handle:
                os.fsync(handle.fileno())
    fsync_dir(tmp)
    if final.exists():  # re-saving the same step (e.g. after a resume): replace it whole
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(root)
    atomic_write_text(root / "latest", final.name + "\n")
    _prune(root, keep=final.name, keep_last=keep_last)
    return final


def _prune(root: Path, keep: str, keep_last: int = KEEP_LAST) -> None:
    done = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in done[:-keep_last]:
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
    """A checkpoint opened for reading slice by slice (common/checkpoint/tensorsource.py): what a resuming rank reads
    its part of the weights and moments from, without ever loading the whole. Either format: whole HF files
    or the sharded one (shards/index.json, common/checkpoint/sharded.py)."""
    step: int
    weights: TensorSource
    exp_avg: TensorSource
    exp_avg_sq: TensorSource
    info: dict

    def as_dict(self) -> dict[str, TensorSource]:
        return {"weights": self.weights, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}


def checkpoint_sources(path: Path) -> Mapping[str, TensorSource]:
    """{"weights", "exp_avg", "exp_avg_sq"} of a checkpoint of either format, as TensorSources that read one
    slice at a time (the format is the directory's: shards/index.json or the whole HF files)."""
    path = Path(path)
    if is_sharded(path):
        return sharded_sources(path)
    for name in ("model.safetensors", "optimizer.safetensors"):
        if not (path / name).is_file():
            raise UserError(f"checkpoint {path} has no {name} (nor shards/{INDEX}); refusing to resume")
    return {"weights": SafetensorsSource(path / "model.safetensors"),
            "exp_avg": SafetensorsSource(path / "optimizer.safetensors", "exp_avg."),
            "exp_avg_sq": SafetensorsSource(path / "optimizer.safetensors", "exp_avg_sq.")}


def open_checkpoint(path: Path, spec: ModelSpec, expect: dict,
                    shapes: dict[str, tuple[int, ...]] | None = None) -> CheckpointSources:
    """Validate (state.json, fingerprints in `expect`, the spec, every tensor's name and shape from the
    files' headers: the spec's parameters, or `shapes`, a LoRA run's adapters) and open the tensors lazily,
    whatever the format; nothing is read yet."""
    path = Path(path)
    try:
        meta = json.loads((path / "state.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"checkpoint {path} has no readable state.json ({err}); refusing to resume") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise UserError(f"checkpoint {path} has format version {meta.get('format_version')}, "
                        f"this dpcompare reads {FORMAT_VERSION}")
    saved_spec = read_spec(path)
    if saved_spec != spec:
        diff = [k for k, v in spec.to_dict().items() if saved_spec.to_dict()[k] != v]
        raise UserError(f"checkpoint {path} was written for another model spec "
                        f"({', '.join(f'{k}={saved_spec.to_dict()[k]}' for k in diff)}); refusing to resume")
    for key, value in expect.items():
        if meta.get(key) != value:
            raise UserError(f"checkpoint {path}: {key} is {meta.get(key)!r}, this run has {value!r}; "
                            "refusing to resume")
    sources = checkpoint_sources(path)
    for kind, source in sources.items():
        check_source(spec, source, f"{path} ({kind})", shapes)
    return CheckpointSources(step=int(meta["step"]), info=meta, **sources)


def load_checkpoint(path: Path, spec: ModelSpec, expect: dict,
                    shapes: dict[str, tuple[int, ...]] | None = None) -> TrainState:
    """Load and validate, whole dicts assembled one tensor at a time; `sources` keeps the lazy readers."""
    opened = open_checkpoint(path, spec, expect, shapes)
    sources = opened.as_dict()
    weights, exp_avg, exp_avg_sq = (read_all(sources[kind]) for kind in ("weights", "exp_avg", "exp_avg_sq"))
    return TrainState(step=opened.step, weights=weights, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq,
                      info=opened.info, sources=sources)


def read_spec(path: Path) -> ModelSpec:
    from common.model.hfconfig import from_hf_config

    config = Path(path) / "config.json"
    try:
        return from_hf_config(json.loads(config.read_text()))
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"checkpoint {path}: config.json is unreadable ({err})") from None
