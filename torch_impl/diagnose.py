"""torch's side of `dpcompare diagnose`: `python -m torch_impl.diagnose PLAN OUT_DIR` (see common/train/step_record.py).

Mirrors mlx_impl/diagnose.py: every module's output, the gradients, and the test hook that plants a
bug in this framework's model or optimizer.
"""
from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from common.train.step_record import run_worker

from .launch import start_world
from .model import RoPE, weights_of  # noqa: F401 - run_worker reads weights_of (and Trainer) from this module
from .step import Trainer, token_loss_sum


def module_outputs(model: nn.Module, tokens: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """[(HF module name, output)] in the order the modules finish, then ("logits", ...)."""
    records = []
    hooks = [module.register_forward_hook(lambda m, args, out, name=name: records.append((name, out.detach())))
             for name, module in model.named_modules() if name]
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            logits = model(torch.from_numpy(tokens).long().to(device))
    finally:
        for hook in hooks:
            hook.remove()
    return [(name, value.float().cpu().numpy()) for name, value in records] + [
        ("logits", logits.float().cpu().numpy())]


def gradients(model: nn.Module, inputs, targets, mask, scale: float) -> dict[str, np.ndarray]:
    """d(sum of masked token losses * scale)/d(parameter), under HF names; leaves .grad empty."""
    device = next(model.parameters()).device
    model.zero_grad(set_to_none=True)
    loss = token_loss_sum(model, torch.from_numpy(inputs).long().to(device),
                          torch.from_numpy(targets).long().to(device), torch.from_numpy(mask).to(device))
    (loss * scale).backward()
    grads = {name: p.grad.float().cpu().numpy().copy() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def inject_bug(trainer: Trainer, bug: str) -> None:
    """Test hook (common.train.step_record.BUGS): plant one real bug in the model or optimizer, after construction."""
    modules = list(trainer.model.modules())
    if bug == "rmsnorm_eps":
        for m in modules:
            if isinstance(m, nn.RMSNorm):
                m.eps = 1e-6
    elif bug == "rope_layout":
        for m in modules:
            if isinstance(m, RoPE):
                m.traditional = True
    elif bug == "adamw_bias_correction":
        setattr(trainer.optimizer, "step", types.MethodType(_adamw_without_bias_correction, trainer.optimizer))
    else:
        raise ValueError(f"no {bug!r} bug for torch")


@torch.no_grad()
def _adamw_without_bias_correction(self, closure=None):
    for group in self.param_groups:
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
            state["step"] += 1
            p.mul_(1 - group["lr"] * group["weight_decay"])
            state["exp_avg"].lerp_(p.grad, 1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            p.addcdiv_(state["exp_avg"], state["exp_avg_sq"].sqrt().add_(group["eps"]), value=-group["lr"])


def main(argv: list[str] | None = None) -> int:
    plan, out_dir = sys.argv[1:] if argv is None else argv
    run_worker(Path(plan), Path(out_dir), start_world, sys.modules[__name__])
    return 0


if __name__ == "__main__":
    from common.train.process_exit import exit_now

    exit_now(main())  # no interpreter teardown: 1-1.5 s of a torch process (common/train/process_exit.py)
