"""`--frameworks mlx-lm`: mlx-lm's own LoRA trainer (`mlx_lm.tuner.trainer.train`), fed dpcompare's batches.

`python -m peers.mlx_lm_peer RUN_DIR`, started by the launchers exactly as `mlx_impl.launch` is (one process, or the
local ring through compare/launch/spawn.py). What runs is mlx-lm's: `mlx_lm.utils.load_model` opens the run's seed
(or --init-from) folder, `linear_to_lora_layers` adapts the run's targets in its last blocks, `train()` steps with
its compiled step, its `default_loss` (one padding target a row, per-rank token means), its `average_gradients` and
an `mlx.optimizers` Adam or AdamW built as `mlx_lm.lora` builds it. dpcompare hands it only:
- the batches, through `train(iterate_batches=...)`: each step's global batch, rank r's share, as (tokens, lengths of
  (offset, length)) in mlx-lm's layout, the run's mask rebuilt as mlx-lm's `steps >= offset and steps <= length`;
- the initial adapters (common/model/lora.py's draws, transposed into `lora_a`, `lora_b`);
and reads back, through its `TrainingCallback`, the loss and time it reports every step (`steps_per_report` 1).
A choice its trainer has no setting for exits 2 before anything starts (common/peers.py).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from common.errors import UserError
from common.model.lora import TARGET_PATHS, Adapters
from common.train.collector import imports_uncollected
from common.train.placement import ROUND_ROBIN, place_rank

from .feed import Feed, peer_main

PEER = "mlx-lm"

def mlx_lm_batch(inputs: np.ndarray, targets: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [B, W + 1], lengths [B, 2] of (offset, length)) that make mlx-lm's default_loss keep exactly `mask`:
    it keeps target step s (1-based) where offset <= s <= length, so a row's kept targets must be one run."""
    tokens = np.concatenate([inputs, targets[:, -1:]], axis=1).astype(np.int32)
    lengths = np.zeros((len(mask), 2), dtype=np.int32)
    for row, kept in enumerate(mask > 0):
        where = np.flatnonzero(kept)
        if not len(where):
            lengths[row] = (1, 0)
            continue
        if not kept[where[0]:where[-1] + 1].all():
            raise UserError(f"--framework {PEER}: a row's targets are not one run (mlx-lm masks a prompt prefix only)")
        lengths[row] = (where[0] + 1, where[-1] + 1)
    return tokens, lengths


def initial_adapters(feed: Feed, adapters: Adapters) -> list:
    """The run's initial adapters under mlx-lm's names and layout: lora_a (in, r) = A^T, lora_b (r, out) = B^T."""
    import mlx.core as mx

    from common.checkpoint.tensorsource import DictSource, SafetensorsSource

    plan = feed.plan
    source = (SafetensorsSource(plan.initial_adapters) if plan.initial_adapters and plan.initial_adapters.is_file()
              else DictSource(adapters.initial_values(plan.spec, feed.cfg.seed)))
    return [(f"{m}.lora_{x.lower()}", mx.array(np.ascontiguousarray(source.read(f"{m}.lora_{x}").T)))
            for m in adapters.modules(plan.spec) for x in "AB"]


def optimizer_of(cfg):
    """The optimizer as `mlx_lm.lora` builds it (lora.py: opt_class(learning_rate=lr, **optimizer_config))."""
    import mlx.optimizers as optim

    config = {"betas": [cfg.beta1, cfg.beta2], "eps": cfg.adam_eps, "bias_correction": cfg.bias_correction}
    lr = cfg.lr
    if cfg.lr_schedule == "cosine":  # an lr_schedule in its YAML config: lora.py lr = build_schedule(args.lr_schedule)
        from mlx_lm.tuner.utils import build_schedule
        lr = build_schedule({"name": "cosine_decay", "arguments": [cfg.lr, cfg.lr_decay_steps or cfg.steps,
                                                                   cfg.lr * cfg.min_lr_ratio]})
    if cfg.optimizer == "adamw":
        return optim.AdamW(learning_rate=lr, weight_decay=cfg.weight_decay, **config)
    return optim.Adam(learning_rate=lr, **config)


def train_rank(run_dir: Path) -> None:
    with imports_uncollected():  # common/train/collector.py; mlx-lm's loop collects as usual
        import mlx.core as mx
        from mlx.utils import tree_flatten
        from mlx_lm.tuner.callbacks import TrainingCallback
        from mlx_lm.tuner.trainer import TrainingArgs, train
        from mlx_lm.tuner.utils import linear_to_lora_layers
        from mlx_lm.utils import load_model

    from common.runplan import RunPlan

    cfg = RunPlan.read(run_dir).config  # validated as it is read: common/peers.py's checks of what mlx-lm takes
    if cfg.device == "cpu" or not mx.is_available(mx.gpu):  # as mlx_impl.launch: auto keeps MLX's default device
        mx.set_default_device(mx.cpu)
    world = mx.distributed.init(backend=cfg.resolved_backend, strict=True) if cfg.world_size > 1 else None
    rank, size = (world.rank(), world.size()) if world is not None else (0, 1)
    feed = Feed.open(run_dir, rank, size)
    adapters = cfg.trained
    assert isinstance(adapters, Adapters)

    model, _ = load_model(Path(feed.plan.seed_checkpoint))
    model.freeze()
    keys = [TARGET_PATHS[t] for t in TARGET_PATHS if t in adapters.targets]
    linear_to_lora_layers(model, len(adapters.blocks(feed.plan.spec)),
                          {"rank": adapters.rank, "scale": adapters.scale, "dropout": 0.0, "keys": keys})
    model.load_weights(initial_adapters(feed, adapters), strict=False)
    mx.eval(model.parameters())
    trainable = dict(tree_flatten(model.trainable_parameters()))
    feed.status.update(force=True, status="running", device=str(mx.default_device()), start_step=0, step=0,
                       weights_bytes_read=sum(v.nbytes for _, v in tree_flatten(model.parameters())))

    def iterate_batches(dataset, batch_size, max_seq_length, loop=False, seed=None, comm_group=None):
        for step in range(cfg.steps):
            (batch,) = feed.batches(step)
            tokens, lengths = mlx_lm_batch(*batch)
            yield mx.array(tokens), mx.array(lengths)

    class Report(TrainingCallback):
        def on_train_loss_report(self, info: dict) -> None:
            feed.record(info["iteration"], info["train_loss"], None, 1.0 / info["iterations_per_second"],
                        info["learning_rate"])

    args = TrainingArgs(batch_size=cfg.global_batch_size, iters=cfg.steps, steps_per_report=1,
                        steps_per_eval=cfg.steps + 1, steps_per_save=cfg.steps + 1, max_seq_length=cfg.seq_len + 1,
                        adapter_file=str(run_dir / "adapters.safetensors"))
    optimizer = optimizer_of(cfg)
    train(model, optimizer, train_dataset=[None], args=args, iterate_batches=iterate_batches,
          training_callback=Report())
    params = sum(v.nbytes for v in trainable.values())
    optimizer_bytes = sum(v.nbytes for _, v in tree_flatten(optimizer.state) if hasattr(v, "nbytes") and v.ndim)
    feed.finish(mx.get_peak_memory(), {"params": params, "grads": params, "optimizer": optimizer_bytes})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    place_rank(argv[0], ROUND_ROBIN)  # as mlx_impl.launch: before MLX starts its threads
    import os

    rank = int(os.environ.get("MLX_RANK", 0))
    return peer_main(argv[0], rank, lambda: train_rank(Path(argv[0])))


if __name__ == "__main__":
    from common.train.process_exit import exit_now

    exit_now(main())  # no interpreter teardown: 1-1.5 s of a torch process (common/train/process_exit.py)
