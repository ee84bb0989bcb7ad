"""One transformer block of a model's real shapes, timed in PyTorch: what `dpcompare plan --model` measures of a
model nobody trained here (common/costmodel/probed.py turns the figures into a step). Mirrors
mlx_impl/block_probe.py name for name.

`python -m torch_impl.block_probe REQUEST.json` reads common/costmodel/probed.py's request and prints one line
`RESULT_PREFIX{json}`: the block's forward, and its forward with the backward a step runs (every gradient under a
full fine-tune; under LoRA the adapters' and the activations'), the head's (embedding lookup, final norm, head,
cross-entropy) the same two ways, and AdamW's update (adamw.py, the step's own) per element. The model's own
classes (model.py, lora.py, quantized.py), eager as the step runs them; the gradients are dropped after each
call, as the step's zero_grad does. Threads come from the environment the parent sets, as a rank's do.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Callable

import torch
import torch.nn as nn

from common.costmodel.probed import MIN_CALLS, RESULT_PREFIX, ProbeRequest, read_request
from common.metrics import held_at_peak_rss

from .adamw import AdamW
from .grads import clip_by_norm, squares_of
from .lora import attach
from .model import (Embedding, Linear, RMSNorm, TransformerBlock, attention_mask, cross_entropy, set_cross_entropy,
                    set_exp)


def timed(fn: Callable[[], object], budget_s: float) -> float:
    """The median of a few calls after one warm-up: MIN_CALLS of them where they take under
    MIN_CALLS x budget_s in all (one call on a loaded machine can be off by a third), up to 7 within budget_s."""
    fn()
    times: list[float] = []
    while len(times) < 7:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        if sum(times) >= MIN_CALLS * budget_s or (len(times) >= MIN_CALLS and sum(times) >= budget_s):
            break
    return statistics.median(times)


class Parts(nn.Module):
    """The modules of one block and the head under their HF paths (model.layers.0, model.embed_tokens, model.norm,
    lm_head), so lora.py and quantized.py find them; `x` is the block's input, with a gradient as the layers below
    need it."""

    def __init__(self, req: ProbeRequest):
        super().__init__()
        spec = req.spec
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([TransformerBlock(spec)])
        self.model.embed_tokens = Embedding(req.vocab_rows, spec.dim)
        self.model.norm = RMSNorm(spec.dim, eps=spec.norm_eps)
        if not spec.tie_embeddings:
            self.lm_head = Linear(spec.dim, req.vocab_rows, bias=False)
        self.x = nn.Parameter(torch.randn(req.rows, req.seq_len, spec.dim).to(getattr(torch, req.dtype)))


def build(req: ProbeRequest) -> Parts:
    parts = Parts(req)
    if req.quantize[0]:  # a quantized base (QLoRA): its modules swapped before the adapters attach, as a rank does
        from .quantized import quantize_base

        quantize_base(parts, req.storage, req.probe_spec)
    attach(parts, req.trained, req.probe_spec)  # LoRA freezes all but the adapters; a full fine-tune trains all
    parts.x.requires_grad_(True)
    return parts


def measure(req: ProbeRequest) -> dict:
    set_exp(req.exp)
    set_cross_entropy(req.cross_entropy)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))
    parts = build(req)
    mask = attention_mask(None, req.seq_len)
    tokens = torch.randint(0, req.vocab_rows, (req.rows, req.seq_len))
    targets = torch.randint(0, req.vocab_rows, (req.rows, req.seq_len))
    trainable = [p for p in parts.parameters() if p.requires_grad]

    def head() -> torch.Tensor:
        h = parts.model.norm(parts.model.embed_tokens(tokens).to(parts.x.dtype) + parts.x)
        logits = parts.model.embed_tokens.as_linear(h) if req.spec.tie_embeddings else parts.lm_head(h)
        return cross_entropy(logits.float(), targets).sum()

    def block_out() -> torch.Tensor:
        return parts.model.layers[0](parts.x, mask).float().sum()

    def stepped(loss: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def step() -> None:
            loss().backward()
            for p in trainable:
                p.grad = None
        return step

    def forward_only(loss: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def forward() -> None:
            with torch.no_grad():
                loss()
        return forward

    figures: dict[str, float | None] = {}
    for name, loss in (("block", block_out), ("head", head)):
        figures[f"{name}_forward_s"] = timed(forward_only(loss), req.budget_s)
        figures[f"{name}_step_s"] = timed(stepped(loss), req.budget_s)
    figures.update(optimizer(req))
    figures["head_peak_bytes"] = held_at_peak_rss(stepped(head))  # last: it changes how malloc maps
    return {**figures, "framework": "torch", "version": torch.__version__}


def optimizer(req: ProbeRequest) -> dict:
    """The step's update as step.py runs it (ddp.py's float64 global norm, grads.py's clip, AdamW) over the
    model's own trained tensors (ProbeRequest.optimizer_tensors): seconds per step for them."""
    sizes = req.optimizer_tensors()
    params = [torch.zeros(n, requires_grad=True) for n in sizes]
    for p in params:
        p.grad = torch.ones(p.numel())
    opt = AdamW([{"params": params}], lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    grads = [p.grad for p in params]

    def once() -> None:
        norm = squares_of(grads, torch.float64, "cpu").sqrt()
        clip_by_norm(grads, 1.0, norm)
        opt.step()
    return {"optimizer_s": timed(once, req.budget_s), "optimizer_elements": sum(sizes)}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    req = read_request(args[0])
    print(RESULT_PREFIX + json.dumps(measure(req)), flush=True)
    return 0


if __name__ == "__main__":
    from common.train.process_exit import exit_now

    exit_now(main())  # no interpreter teardown: 1-1.5 s of a torch process (common/train/process_exit.py)
