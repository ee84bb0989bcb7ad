"""Greedy continuation for the report: `python -m mlx_impl.sample WEIGHTS_DIR OUT_JSON IDS MAX_NEW_TOKENS`.

The loop is common/train/generate.py's; this file gives it the model and one greedy token. compare/launch/sample.py
runs it after training and writes the run's sample.json.
"""
from __future__ import annotations

import sys
from typing import cast

import mlx.core as mx

from common.train.generate import sample_main

from .model import from_pretrained


def next_token(model, window: list[int]) -> int:
    logits = model(mx.array([window]))[0, -1]
    return cast(int, mx.argmax(logits.astype(mx.float32)).item())  # an integer array


def main(argv: list[str] | None = None) -> int:
    return sample_main(argv, from_pretrained, next_token)


if __name__ == "__main__":
    sys.exit(main())
