"""Greedy continuation for the report's samples, the same loop for both frameworks.

compare/launch/sample.py tokenizes the prompt, runs `python -m {mlx,torch}_impl.sample RUN_DIR CHECKPOINT_DIR
OUT_JSON IDS MAX_NEW_TOKENS` (IDS comma-separated) and decodes OUT_JSON's {"tokens": [...]}, the new tokens only.
The weights are the run's as its ranks read them (`sample_weights`): the checkpoint's, and under LoRA the frozen
base the run trained over (its seed or --init-from file, float32 or quantized) with the checkpoint's adapters.
A backend's sample.py supplies two hooks, the way fabric.py and diagnosis.py take theirs: `load(plan, weights)
-> model`, the run's model (its base storage and adapters, common/model/lora.py) filled from a TensorSource, and
`next_token(model, window) -> int`, the argmax of the last position's logits for the token ids `window`.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable

from common.checkpoint.store import open_checkpoint
from common.checkpoint.tensorsource import TensorSource, UnionSource, probe_checksum
from common.errors import UserError
from common.runplan import RunPlan


def generate(model: Any, next_token: Callable[[Any, list[int]], int], prompt: list[int], max_new_tokens: int,
             max_seq_len: int) -> list[int]:
    """The whole window again for every token (no KV cache), so each step's logits are those of an ordinary
    forward pass, as in training."""
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        tokens.append(next_token(model, tokens[-max_seq_len:]))
    return tokens[len(prompt):]


def sample_weights(run_dir: Path, checkpoint: Path) -> tuple[RunPlan, TensorSource]:
    """(the run's plan, the weights to sample from): what the checkpoint trained, read as a rank resumes it
    (common/train/loop.py start_trainer), with a LoRA run's frozen base beside its adapters. The base is the one
    the checkpoint names by its checksum (`base_checksum`, as `dpcompare export --adapters` finds it: the plan's
    seed or --init-from file); another file there is refused."""
    from common.train.loop import frozen_base, seed_source

    plan = RunPlan.read(run_dir)
    cfg, spec = plan.config, plan.spec
    state = open_checkpoint(checkpoint, spec, {}, cfg.trained.state_shapes(spec))
    if not frozen_base(cfg, spec):
        return plan, state.weights
    base = seed_source(plan)
    if state.info.get("base_checksum") != probe_checksum(base):
        raise UserError(f"{checkpoint} holds adapters trained over another base than {base.path}")
    return plan, UnionSource(state.weights, base)


def sample_main(argv: list[str] | None, load: Callable[[RunPlan, TensorSource], Any],
                next_token: Callable[[Any, list[int]], int]) -> int:
    run_dir, checkpoint, out, ids, max_new_tokens = sys.argv[1:] if argv is None else argv
    model = load(*sample_weights(Path(run_dir), Path(checkpoint)))
    tokens = generate(model, next_token, [int(i) for i in ids.split(",")], int(max_new_tokens), model.spec.max_seq_len)
    Path(out).write_text(json.dumps({"tokens": tokens}))
    return 0
