"""One training step, recorded tensor by tensor, for `dpcompare diagnose` (the part both frameworks share).

compare/diagnose.py writes a plan (diagnose_plan.json) and starts `python -m {mlx,torch}_impl.diagnose
PLAN OUT_DIR` once per framework; each worker builds the framework's real Trainer from the same weights
(and optimizer state, from a checkpoint), takes the same batch, and records in OUT_DIR:

    forward    every module's output, in the order the modules finish (HF names; a module called more
               than once, like RoPE for q and k, gets `#2`, `#3` on its later calls), then `logits`
    loss       the loss the Trainer reports for that step (before its update)
    gradient   every parameter's gradient of the loss (the step's mean token loss)
    update     every parameter's change in the Trainer's optimizer step (after - before), with the
               float32 spacing of its largest weight (`rounding`: the least difference storage makes)

as one .npy file per tensor and a manifest.json listing (stage, name, file) in that order.

A framework module (mlx_impl/diagnose.py, torch_impl/diagnose.py) supplies `Trainer`, `weights_of`,
`module_outputs`, `gradients` and `inject_bug`; `run_worker` does the rest, in one process.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.checkpoint.store import load_checkpoint
from common.config import RunConfig
from common.errors import UserError
from common.data.sampler import sampler_for
from common.train.lr_schedule import lr_for
from common.data.sequences import SequenceView
from common.model.lora import Adapters
from common.model.spec import ModelSpec
from common.data.tokencache import TokenCache
from common.model.weights import load_pretrained

STAGES = ("forward", "loss", "gradient", "update")
# Test hook (DPCOMPARE_INJECT_BUG="framework=mlx,bug=rmsnorm_eps"): real bugs, planted in one framework
# so the tests can check that the diagnosis names the right stage and module.
BUGS = {
    "rmsnorm_eps": "RMSNorm eps 1e-6 instead of the spec's",
    "rope_layout": "RoPE in the interleaved (traditional) layout instead of rotate-half",
    "adamw_bias_correction": "AdamW without bias correction",
    "loss_mask": "the loss ignores the padding mask",
}


@dataclass
class DiagnosisInputs:
    cfg: RunConfig
    spec: ModelSpec
    weights: dict[str, np.ndarray]
    optimizer: tuple | None          # (exp_avg, exp_avg_sq, step) from a checkpoint, else None
    batch: tuple                     # (inputs, targets, mask) of the whole global batch
    global_tokens: int
    lr: float
    step: int                        # completed steps before this one


@dataclass(frozen=True)
class DiagnosisPlan:
    """What every diagnosis worker reads (diagnose_plan.json): the same config, weights and step for both
    frameworks. `checkpoint` is a run's checkpoint to start from, else the seed checkpoint `weights`."""
    config: RunConfig
    spec: ModelSpec
    token_cache: Path
    weights: Path
    checkpoint: Path | None
    step: int                        # completed steps before the diagnosed one

    def write(self, path: Path) -> None:
        Path(path).write_text(json.dumps({
            "config": self.config.to_dict(), "spec": self.spec.to_dict(), "token_cache": str(self.token_cache),
            "weights": str(self.weights), "checkpoint": str(self.checkpoint) if self.checkpoint else None,
            "step": self.step}, indent=2))

    @classmethod
    def read(cls, path: Path) -> "DiagnosisPlan":
        raw = json.loads(Path(path).read_text())
        return cls(RunConfig.from_dict(raw["config"]), ModelSpec.from_dict(raw["spec"]), Path(raw["token_cache"]),
                   Path(raw["weights"]), Path(raw["checkpoint"]) if raw["checkpoint"] else None, int(raw["step"]))

    def inputs(self) -> DiagnosisInputs:
        """The weights (and optimizer state, from a checkpoint) and the global batch of the diagnosed step."""
        cfg, step, optimizer = self.config, self.step, None
        trained = cfg.trained  # every parameter, or LoRA's adapters over the frozen seed (common/model/lora.py)
        if self.checkpoint:
            state = load_checkpoint(self.checkpoint, self.spec, {}, trained.state_shapes(self.spec))
            weights, optimizer = state.weights, (state.exp_avg, state.exp_avg_sq, state.step)
        else:  # what a run starts from: the seed, and LoRA's adapters drawn from the run's seed (loop.start_trainer)
            weights = trained.initial_values(self.spec, cfg.seed)  # {} where the seed holds every trained tensor
        if isinstance(trained, Adapters) or not self.checkpoint:  # adapters train over the seed's frozen base
            weights = {**load_pretrained(self.weights)[1], **weights}
        view = SequenceView(TokenCache.open(self.token_cache).split("train"), cfg.seq_len, cfg.sequence,
                            mask_prompt=cfg.mask_prompt, mask_convention=cfg.mask_convention,
                            padding_rule=cfg.padding_rule)
        indices = sampler_for(cfg.data_order, view.num_samples, cfg.global_batch_size, cfg.seed,
                              view.sample_lengths).global_batch_indices(step)
        return DiagnosisInputs(cfg, self.spec, weights, optimizer, view.batch(indices),
                               view.real_target_count(indices), lr_for(cfg, step), step)


class TensorStore:
    """Tensors to .npy files plus an ordered manifest; float64 on disk so nothing is lost in the comparison."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.entries: list[dict] = []
        self._seen: dict[tuple[str, str], int] = {}

    def add(self, stage: str, name: str, value, **info) -> None:
        calls = self._seen[(stage, name)] = self._seen.get((stage, name), 0) + 1
        if calls > 1:
            name = f"{name}#{calls}"
        file = f"{len(self.entries):04d}.npy"
        value = np.asarray(value, dtype=np.float32 if stage != "loss" else np.float64)
        np.save(self.directory / file, value)
        self.entries.append({"stage": stage, "name": name, "file": file, "shape": list(value.shape), **info})

    def close(self, info: dict) -> None:
        (self.directory / "manifest.json").write_text(json.dumps({**info, "entries": self.entries}, indent=2))


def read_store(directory: Path) -> tuple[dict, list[dict]]:
    manifest = json.loads((Path(directory) / "manifest.json").read_text())
    return manifest, manifest["entries"]


def injected_bug(framework: str) -> str | None:
    """Test hook: the bug DPCOMPARE_INJECT_BUG="framework=F,bug=NAME" plants in framework F, if any."""
    spec = os.environ.get("DPCOMPARE_INJECT_BUG")
    if not spec:
        return None
    fields = dict(item.split("=", 1) for item in spec.split(",") if "=" in item)
    if fields.get("framework") != framework:
        return None
    bug = fields.get("bug")
    if bug not in BUGS:
        raise UserError(f"DPCOMPARE_INJECT_BUG: unknown bug {bug!r}; allowed: {', '.join(BUGS)}")
    return bug


def run_worker(plan_path: Path, out_dir: Path, start_world, framework_module) -> None:
    """One framework's side of a diagnosis: the Trainer's own step, recorded stage by stage.
    `start_world` is the framework's launch.start_world (one process here)."""
    d = DiagnosisPlan.read(plan_path).inputs()
    world = start_world(d.cfg)  # the plan's config has one rank
    trainer = framework_module.Trainer(d.cfg, d.spec, d.weights, world)
    if d.optimizer is not None:
        trainer.import_optimizer(*d.optimizer)
    bug = injected_bug(trainer.framework)
    inputs, targets, mask = d.batch
    if bug == "loss_mask":
        mask = np.ones_like(mask)
    elif bug:
        framework_module.inject_bug(trainer, bug)
    store = TensorStore(out_dir)
    for name, value in framework_module.module_outputs(trainer.model, inputs):
        store.add("forward", name, value)
    gradients = framework_module.gradients(trainer.model, inputs, targets, mask, 1.0 / d.global_tokens)
    before = framework_module.weights_of(trainer.model)
    loss, grad_norm = trainer.train_step([(inputs, targets, mask)], d.lr, d.global_tokens)
    store.add("loss", "loss", loss)
    after = framework_module.weights_of(trainer.model)
    # what trains (every parameter, or LoRA's adapters), in forward order, under HF names
    order = [name for name in d.cfg.trained.state_shapes(d.spec) if name in before]
    for name in order:
        store.add("gradient", name, gradients[name])
    for name in order:
        # Storing the new weights in float32 rounds them by half a unit in the last place: the two
        # frameworks' updates of equal weights may differ by that much at least.
        store.add("update", name, after[name].astype(np.float64) - before[name],
                  rounding=float(np.spacing(np.abs(after[name]).max().astype(np.float32))))
    store.close({"framework": trainer.framework, "bug": bug, "step": d.step, "lr": d.lr,
                 "global_tokens": d.global_tokens, "grad_norm": grad_norm, "device": str(trainer.device)})
