"""PyTorch's AdamW update without building a `torch.optim.Optimizer`.

`AdamW.step` runs `torch.optim.adam.adam` with decoupled weight decay: the very function
`torch.optim.AdamW.step` calls, with the same arguments, so the same kernels and the same numbers
(tests/unit/test_torch_adamw.py checks them bit for bit against torch.optim.AdamW). The moments are kept as
torch keeps them (`state[param]`: a CPU float32 `step`, `exp_avg`, `exp_avg_sq` placed like the parameter), and
so are the groups (`param_groups`: `params`, `lr`, `betas`, `eps`, `weight_decay`), so the checkpoints, the
state counts and torch_impl/diagnose.py's planted bug read them unchanged.

Why not torch.optim.AdamW itself: building any torch.optim.Optimizer imports torch._dynamo (its
`add_param_group`, `zero_grad` and `step` are wrapped by `torch._disable_dynamo`), 1.1 s of every torch rank's
start on an AMD EPYC Zen 4, and more than the rest of a ddp rank's start-up but `import torch`. Hundreds of ranks
start in a test run. torch.compile (`--torch-compile`) compiles the model, not the update, as before.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.optim.adam import adam


class AdamW:
    """`bias_correction=False` is MLX's Adam and AdamW by default (mlx/optimizers/optimizers.py Adam.apply_single):
    the moments' running averages used as they are, lr * m / (sqrt(v) + eps), which torch's `adam` cannot compute
    (it always divides by 1 - beta^t), so that update is written out below in MLX's order of operations.
    `decoupled=False` is torch.optim.Adam's weight decay (L2, added to the gradient)."""

    def __init__(self, param_groups: list[dict[str, Any]], lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, bias_correction: bool = True, decoupled: bool = True):
        self.bias_correction, self.decoupled = bias_correction, decoupled
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        self.param_groups = [{**defaults, **group, "params": list(group["params"])} for group in param_groups]
        self.state: defaultdict[torch.Tensor, dict[str, torch.Tensor]] = defaultdict(dict)  # as torch's

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if not self.state[p]:  # as Adam._init_group: the step on the CPU, the moments placed like p
                    self.state[p].update(step=torch.tensor(0.0, dtype=torch.float32),
                                         exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                                         exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format))
            states = [self.state[p] for p in params]
            beta1, beta2 = group["betas"]
            if not self.bias_correction:
                _uncorrected(params, states, beta1, beta2, group["lr"], group["eps"], group["weight_decay"],
                             self.decoupled)
                continue
            adam(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                 [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states],
                 foreach=None, capturable=False, differentiable=False, fused=None, grad_scale=None,
                 found_inf=None, has_complex=False, decoupled_weight_decay=self.decoupled, amsgrad=False,
                 beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                 maximize=False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As Optimizer.zero_grad: drop the gradients, or zero them in place (DDP's bucket views stay)."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    p.grad.zero_()


def _uncorrected(params: list[torch.Tensor], states: list[dict[str, torch.Tensor]], beta1: float, beta2: float,
                 lr: float, eps: float, weight_decay: float, decoupled: bool) -> None:
    """Adam without bias correction, as MLX computes it: m = b1 m + (1 - b1) g, v = b2 v + (1 - b2) g^2, then
    p (1 - lr wd) (AdamW) - lr m / (sqrt(v) + eps)."""
    for p, state in zip(params, states):
        grad = p.grad if decoupled or not weight_decay else p.grad + weight_decay * p
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.mul_(beta1).add_(grad, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        state["step"] += 1
        if decoupled and weight_decay:
            p.mul_(1 - lr * weight_decay)
        p.addcdiv_(m, v.sqrt().add_(eps), value=-lr)
