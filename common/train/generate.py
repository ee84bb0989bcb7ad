"""Greedy continuation for the report's samples, the same loop for both frameworks.

compare/launch/sample.py tokenizes the prompt, runs `python -m {mlx,torch}_impl.sample WEIGHTS_DIR OUT_JSON
IDS MAX_NEW_TOKENS` (IDS comma-separated) and decodes OUT_JSON's {"tokens": [...]}, the new tokens only.
A backend's sample.py supplies two hooks, the way fabric.py and diagnosis.py take theirs: `load(weights_dir)
-> model` and `next_token(model, window) -> int`, the argmax of the last position's logits for the token ids
`window`.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable


def generate(model: Any, next_token: Callable[[Any, list[int]], int], prompt: list[int], max_new_tokens: int,
             max_seq_len: int) -> list[int]:
    """The whole window again for every token (no KV cache), so each step's logits are those of an ordinary
    forward pass, as in training."""
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        tokens.append(next_token(model, tokens[-max_seq_len:]))
    return tokens[len(prompt):]


def sample_main(argv: list[str] | None, load: Callable[[str], Any], next_token: Callable[[Any, list[int]], int]) -> int:
    weights_dir, out, ids, max_new_tokens = sys.argv[1:] if argv is None else argv
    model = load(weights_dir)
    tokens = generate(model, next_token, [int(i) for i in ids.split(",")], int(max_new_tokens), model.spec.max_seq_len)
    Path(out).write_text(json.dumps({"tokens": tokens}))
    return 0
