"""Greedy continuation for the report: `python -m torch_impl.sample WEIGHTS_DIR OUT_JSON IDS MAX_NEW_TOKENS`.

The loop is common/train/generate.py's; this file gives it the model and one greedy token. compare/launch/sample.py
runs it after training and writes the run's sample.json.
"""
from __future__ import annotations

import sys

import torch

from common.train.generate import sample_main

from .model import from_pretrained


@torch.no_grad()
def next_token(model, window: list[int]) -> int:
    logits = model(torch.tensor([window], device=next(model.parameters()).device))[0, -1]
    return int(torch.argmax(logits.float()).item())


def main(argv: list[str] | None = None) -> int:
    return sample_main(argv, from_pretrained, next_token)


if __name__ == "__main__":
    sys.exit(main())
