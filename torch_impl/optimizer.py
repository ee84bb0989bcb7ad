"""The optimizer a run asks for (`--optimizer`, `--bias-correction`, a recipe's choices): torch's update (adamw.py)
built from the RunConfig. Mirrors mlx_impl/optimizer.py, so both frameworks compute the same update under every
recipe: adam (no weight decay: refused in common/config_checks.py) or adamw, bias-corrected or not."""
from __future__ import annotations

from typing import Any

from common.config import RunConfig

from .adamw import AdamW


def make_optimizer(cfg: RunConfig, param_groups: list[dict[str, Any]]) -> AdamW:
    return AdamW(param_groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps,
                 weight_decay=cfg.weight_decay, bias_correction=cfg.bias_correction,
                 decoupled=cfg.optimizer == "adamw")
