"""MLX's side of `dpcompare diagnose`: `python -m mlx_impl.diagnose PLAN OUT_DIR` (see common/train/step_record.py).

Mirrors torch_impl/diagnose.py: every module's output, the gradients, and the test hook that plants a
bug in this framework's model or optimizer.
"""
from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from common.train.step_record import run_worker

from .launch import start_world
from .model import RoPE, weights_of  # noqa: F401 - run_worker reads weights_of (and Trainer) from this module
from .step import Trainer, token_loss_sum


def module_outputs(model: nn.Module, tokens: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """[(HF module name, output)] in the order the modules finish, then ("logits", ...).

    MLX has no forward hooks: each module's class is swapped for a subclass that records its output
    while this forward runs, and put back afterwards."""
    records: list[tuple[str, mx.array]] = []
    names: dict[int, str] = {}
    swapped: list = []
    for name, module in model.named_modules():
        if name:
            names[id(module)] = name
            swapped.append((module, type(module)))
            module.__class__ = _recording(type(module), records, names)
    try:
        logits = model(mx.array(tokens))
    finally:
        for module, cls in swapped:
            module.__class__ = cls
    mx.eval(logits, [value for _, value in records])
    return [(name, np.array(value.astype(mx.float32))) for name, value in records] + [
        ("logits", np.array(logits.astype(mx.float32)))]


def _recording(cls, records: list, names: dict):
    def __call__(self, *args, **kwargs):
        out = cls.__call__(self, *args, **kwargs)
        records.append((names[id(self)], out))
        return out

    return type(cls.__name__, (cls,), {"__call__": __call__})


def gradients(model: nn.Module, inputs, targets, mask, scale: float) -> dict[str, np.ndarray]:
    """d(sum of masked token losses * scale)/d(parameter), eagerly, under HF names."""
    loss_and_grad = nn.value_and_grad(model, lambda x, y, m: token_loss_sum(model, x, y, m)[0] * scale)
    _, grads = loss_and_grad(mx.array(inputs), mx.array(targets), mx.array(mask))
    mx.eval(grads)
    return {name: np.array(g.astype(mx.float32)) for name, g in tree_flatten(grads)}


def inject_bug(trainer: Trainer, bug: str) -> None:
    """Test hook (common.train.step_record.BUGS): plant one real bug in the model or optimizer, after construction."""
    modules = [m for _, m in trainer.model.named_modules()]
    if bug == "rmsnorm_eps":
        for m in modules:
            if isinstance(m, nn.RMSNorm):
                m.eps = 1e-6
    elif bug == "rope_layout":
        for m in modules:
            if isinstance(m, RoPE):
                m.traditional = True
    elif bug == "adamw_bias_correction":
        setattr(trainer.optimizer, "bias_correction", False)
    else:
        raise ValueError(f"no {bug!r} bug for MLX")


def main(argv: list[str] | None = None) -> int:
    plan, out_dir = sys.argv[1:] if argv is None else argv
    run_worker(Path(plan), Path(out_dir), start_world, sys.modules[__name__])
    return 0


if __name__ == "__main__":
    from common.train.process_exit import exit_now

    exit_now(main())  # no interpreter teardown: 1-1.5 s of a torch process (common/train/process_exit.py)
