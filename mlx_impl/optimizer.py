"""The optimizer a run asks for (`--optimizer`, `--bias-correction`, a recipe's choices): MLX's Adam or AdamW
built from the RunConfig. Mirrors torch_impl/optimizer.py, so both frameworks compute the same update under every
recipe. MLX's own default is no bias correction (mlx/optimizers/optimizers.py Adam.__init__), which mlx-lm runs;
dpcompare's recipe asks for it, as torch always does."""
from __future__ import annotations

import mlx.optimizers as optim

from common.config import RunConfig


def make_optimizer(cfg: RunConfig) -> optim.Adam:
    if cfg.optimizer == "adam":  # no weight decay (common/config_checks.py refuses one)
        return optim.Adam(learning_rate=cfg.lr, betas=[cfg.beta1, cfg.beta2], eps=cfg.adam_eps,
                          bias_correction=cfg.bias_correction)
    return optim.AdamW(learning_rate=cfg.lr, betas=[cfg.beta1, cfg.beta2], eps=cfg.adam_eps,
                       weight_decay=cfg.weight_decay, bias_correction=cfg.bias_correction)
