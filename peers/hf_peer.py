"""`--frameworks hf`: transformers' own `Trainer.train()` on a peft LoRA model, fed dpcompare's batches.

`python -m peers.hf_peer RUN_DIR`, started by the launchers as `torch_impl.launch` is: one process, or N local ranks
with torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR/PORT: compare/launch/spawn.py --torch), from which
accelerate starts DDP over gloo itself. What runs is the Trainer's: `AutoModelForCausalLM.from_pretrained` opens the
run's seed (or --init-from) folder, `get_peft_model` adapts it (`LoraConfig`: r, lora_alpha, target_modules,
layers_to_transform), and `Trainer.train()` does the rest: its loss over `num_items_in_batch`
(`average_tokens_across_devices`: global-tokens; off: per-rank), its `adamw_torch`, its lr scheduler, its clipping
(`max_grad_norm`), DDP's gradient average. dpcompare hands it only:
- the batches, through an overridden `get_train_dataloader`: a DataLoader whose item k is optimizer step k's
  micro-batch of this rank (input_ids [B, W + 1] and labels, -100 where the run's mask drops a target; the model
  shifts them once), and which accelerate does not shard again (it is not `prepare`d);
- the initial adapters (common/model/lora.py's draws, copied into lora_A and lora_B);
and reads back, through a `TrainerCallback`, the loss, grad norm and lr it logs every step (`logging_steps` 1) and the
time from its `on_step_begin` to `on_step_end`. A choice it has no setting for exits 2 before anything starts
(common/peers.py).
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from common.model.lora import Adapters
from common.train.collector import imports_uncollected
from common.train.placement import KERNEL, place_rank

from .feed import Feed, peer_main

IGNORE = -100  # the label transformers' loss skips


def hf_batch(inputs: np.ndarray, targets: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
    """input_ids and labels that make LlamaForCausalLM's shifted loss keep exactly `mask`'s targets: the row's
    tokens and its last target, and labels aligned with them (label t + 1 is input t's target)."""
    input_ids = np.concatenate([inputs, targets[:, -1:]], axis=1).astype(np.int64)
    labels = np.full(input_ids.shape, IGNORE, dtype=np.int64)
    labels[:, 1:] = np.where(mask > 0, targets, IGNORE)
    return {"input_ids": input_ids, "labels": labels}


def train_rank(run_dir: Path) -> None:
    with imports_uncollected():  # common/train/collector.py; the Trainer's loop collects as usual
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from common.runplan import RunPlan

    cfg = RunPlan.read(run_dir).config  # validated as it is read: common/peers.py's checks of what the Trainer takes
    torch.set_num_threads(cfg.threads_per_rank)
    # where our torch runs (torch_impl.launch's pick_device): CUDA for auto or cuda where torch sees it, else the CPU
    on_cpu = cfg.device in ("cpu", "mps") or not torch.cuda.is_available()
    rank, size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    feed = Feed.open(run_dir, rank, size)
    adapters = cfg.trained
    assert isinstance(adapters, Adapters)
    spec = feed.plan.spec

    model = AutoModelForCausalLM.from_pretrained(str(feed.plan.seed_checkpoint), dtype=torch.float32)
    alpha: Any = adapters.alpha  # a float (peft's scaling is lora_alpha / r; its annotation says int)
    lora = LoraConfig(r=adapters.rank, lora_alpha=alpha, target_modules=list(adapters.targets),
                      layers_to_transform=list(adapters.blocks(spec)) if adapters.layers else None,
                      lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    initial = initial_adapters(feed, adapters)
    with torch.no_grad():
        for module in adapters.modules(spec):
            layer = model.base_model.model.get_submodule(module)
            layer.lora_A["default"].weight.copy_(torch.from_numpy(initial[f"{module}.lora_A"]))
            layer.lora_B["default"].weight.copy_(torch.from_numpy(initial[f"{module}.lora_B"]))
    feed.status.update(force=True, status="running", device="cpu" if on_cpu else f"cuda:{os.environ.get('LOCAL_RANK', 0)}",
                       start_step=0, step=0,
                       weights_bytes_read=sum(p.numel() * p.element_size() for p in model.parameters()))

    class StepBatches(torch.utils.data.Dataset):
        """Item k: this rank's micro-batch of optimizer step k, as the Trainer's model takes it."""
        def __len__(self) -> int:
            return cfg.steps

        def __getitem__(self, step: int) -> dict:
            (batch,) = feed.batches(step)
            return {k: torch.from_numpy(v) for k, v in hf_batch(*batch).items()}

    class FedTrainer(Trainer):
        def get_train_dataloader(self):
            return torch.utils.data.DataLoader(self.train_dataset, batch_size=None, shuffle=False)

    class Report(TrainerCallback):
        started = 0.0
        step_time = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.step_time = time.perf_counter() - self.started

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                feed.record(state.global_step, logs["loss"], logs.get("grad_norm"), self.step_time,
                            logs.get("learning_rate"))

    args = TrainingArguments(
        output_dir=str(run_dir / "trainer"), max_steps=cfg.steps, per_device_train_batch_size=cfg.micro_batch_size,
        gradient_accumulation_steps=cfg.grad_accum, learning_rate=cfg.lr, adam_beta1=cfg.beta1, adam_beta2=cfg.beta2,
        adam_epsilon=cfg.adam_eps, weight_decay=cfg.weight_decay, optim="adamw_torch",
        lr_scheduler_type="linear" if cfg.lr_schedule == "linear" else
        ("constant_with_warmup" if cfg.warmup_steps else "constant"), warmup_steps=cfg.warmup_steps,
        max_grad_norm=cfg.grad_clip, average_tokens_across_devices=cfg.loss_normalization == "global-tokens",
        logging_strategy="steps", logging_steps=1, save_strategy="no", eval_strategy="no", report_to="none",
        disable_tqdm=True, use_cpu=on_cpu, seed=cfg.seed, dataloader_num_workers=0,
        ddp_backend=cfg.resolved_backend if size > 1 else None,
        remove_unused_columns=False)
    trainer = FedTrainer(model=model, args=args, train_dataset=StepBatches(), callbacks=[Report()])
    trainer.train()
    params = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    feed.finish(None if on_cpu else torch.cuda.max_memory_allocated(),
                {"params": params, "grads": params, "optimizer": 2 * params})


def initial_adapters(feed: Feed, adapters: Adapters) -> dict[str, np.ndarray]:
    """The run's initial adapters in peft's layout (lora_A (r, in), lora_B (out, r): dpcompare's own)."""
    from common.checkpoint.tensorsource import DictSource, SafetensorsSource

    plan = feed.plan
    source = (SafetensorsSource(plan.initial_adapters) if plan.initial_adapters and plan.initial_adapters.is_file()
              else DictSource(adapters.initial_values(plan.spec, feed.cfg.seed)))
    return {f"{m}.lora_{x}": np.ascontiguousarray(source.read(f"{m}.lora_{x}"))
            for m in adapters.modules(plan.spec) for x in "AB"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    place_rank(argv[0], KERNEL)  # as torch_impl.launch
    return peer_main(argv[0], int(os.environ.get("RANK", 0)), lambda: train_rank(Path(argv[0])))


if __name__ == "__main__":
    from common.train.process_exit import exit_now

    exit_now(main())  # no interpreter teardown: 1-1.5 s of a torch process (common/train/process_exit.py)
