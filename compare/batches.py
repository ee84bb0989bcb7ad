"""`dpcompare batches RUN_DIR --steps A:B --out FILE.npz`: each optimizer step's global batch, as the run saw it, for
another implementation to be fed the same data in the same order.

The batch of step s (0-based, as the loop counts: metrics.jsonl's row s + 1) is the sampler's global indices read
through the run's own view of its token cache (common/data/sequences.py: packing or one sample per record, padding
and --mask-prompt as the run had them), so it is what every rank's slices add up to. FILE.npz holds `steps` (S,),
`inputs` and `targets` (S, B, T) int32, `mask` (S, B, T) float32 (1 where a target counts), `indices` (S, B), and
`tokens` (S,): the global count of targets each step's loss is divided by (global-tokens normalization).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from common.data.sampler import sampler_for
from common.data.sequences import SequenceView
from common.data.tokencache import TokenCache
from common.errors import UserError
from common.runplan import RunPlan


def parse_steps(text: str, total: int) -> range:
    """"A:B" (steps A to B-1, 0-based, B at most the run's --steps), "A:" (to the end) or "A" (one step)."""
    first, sep, last = text.partition(":")
    try:
        start = int(first) if first else 0
        stop = (int(last) if last else total) if sep else start + 1
    except ValueError:
        raise UserError(f"--steps {text!r}: write A:B, A: or A (0-based steps, as in metrics.jsonl's step - 1)") from None
    if not 0 <= start < stop <= total:
        raise UserError(f"--steps {text!r}: the run has steps 0 to {total - 1}; A:B needs 0 <= A < B <= {total}")
    return range(start, stop)


def write_batches(run_dir: Path, steps_text: str, out: Path) -> int:
    """Write FILE.npz; returns the number of steps written."""
    plan = RunPlan.read(run_dir)
    cfg = plan.config
    steps = parse_steps(steps_text, cfg.steps)
    view = SequenceView(TokenCache.open(plan.token_cache).split("train"), cfg.seq_len, cfg.sequence,
                        mask_prompt=cfg.mask_prompt, mask_convention=cfg.mask_convention,
                        padding_rule="seq-len")  # every step's rows to --seq-len: one array for all steps
    sampler = sampler_for(cfg.data_order, view.num_samples, cfg.global_batch_size, cfg.seed, view.sample_lengths)
    indices = [sampler.global_batch_indices(step) for step in steps]
    batches = [view.batch(i) for i in indices]
    if out.exists():
        raise UserError(f"{out} exists; choose another --out (nothing is overwritten)")
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(out, steps=np.array(list(steps)), inputs=np.stack([b[0] for b in batches]),
             targets=np.stack([b[1] for b in batches]), mask=np.stack([b[2] for b in batches]),
             indices=np.stack(indices), tokens=np.array([view.real_target_count(i) for i in indices]))
    return len(steps)
