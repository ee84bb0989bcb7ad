"""Greedy continuation for the report: `python -m mlx_impl.sample RUN_DIR CHECKPOINT_DIR OUT_JSON IDS MAX_NEW_TOKENS`.

The loop and the weights are common/train/generate.py's; this file gives it the run's model and one greedy token.
compare/launch/sample.py runs it after training and writes the run's sample.json.
"""
from __future__ import annotations

from typing import cast

import mlx.core as mx

from common.checkpoint.tensorsource import TensorSource
from common.runplan import RunPlan
from common.train.generate import sample_main

from .load import load_local
from .lora import attach
from .model import Llama
from .quantized import quantize_base


def load(plan: RunPlan, weights: TensorSource) -> Llama:
    """The run's model as its ranks build it (step.py: the base's storage, then LoRA's adapters where it trains
    them), in float32, every tensor whole from `weights`."""
    cfg, spec = plan.config, plan.spec
    model = Llama(spec)
    quantize_base(model, cfg.base_storage, spec)
    attach(model, cfg.trained, spec)
    load_local(model, weights, lambda name, shape: ())
    model.eval()
    return model


def next_token(model, window: list[int]) -> int:
    logits = model(mx.array([window]))[0, -1]
    return cast(int, mx.argmax(logits.astype(mx.float32)).item())  # an integer array


def main(argv: list[str] | None = None) -> int:
    return sample_main(argv, load, next_token)


if __name__ == "__main__":
    from common.train.process_exit import exit_now

    exit_now(main())  # no interpreter teardown: 1-1.5 s of a torch process (common/train/process_exit.py)
