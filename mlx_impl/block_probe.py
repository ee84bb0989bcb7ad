"""One transformer block of a model's real shapes, timed in MLX: what `dpcompare plan --model` measures of a model
nobody trained here (common/costmodel/probed.py turns the figures into a step). Mirrors torch_impl/block_probe.py
name for name.

`python -m mlx_impl.block_probe REQUEST.json` reads common/costmodel/probed.py's request (the spec, the rows and
sequence length of a micro-batch, the dtype, what trains, the base's storage, the vocabulary rows of the head, the
optimizer's elements) and prints one line `RESULT_PREFIX{json}`: the block's forward, and its forward with the
backward a step runs (every gradient under a full fine-tune; under LoRA the adapters' and the activations'), the
head's (embedding lookup, final norm, head, cross-entropy) the same two ways, and AdamW's update per element. The
model's own classes (model.py, lora.py, quantized.py) under `mx.compile`, as the step runs them; the weights'
values do not matter to the time, so placeholders serve. Threads, BLAS and exp come from the environment the
parent sets, as a rank's do.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten

from common.costmodel.probed import MIN_CALLS, RESULT_PREFIX, ProbeRequest, read_request
from common.metrics import held_at_peak_rss

from .grads import clip_by_norm, squares_of
from .kernel_choice import probe_attention
from .lora import attach
from .model import (Embedding, Linear, RMSNorm, TransformerBlock, attention_mask, cross_entropy, set_attention,
                    set_cross_entropy, set_exp)


def timed(fn: Callable[[], object], budget_s: float) -> float:
    """The median of a few evaluated calls after one warm-up (which compiles): MIN_CALLS of them where they take under
    MIN_CALLS x budget_s in all (one call on a loaded machine can be off by a third), up to 7 within budget_s."""
    mx.eval(fn())
    times: list[float] = []
    while len(times) < 7:
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
        if sum(times) >= MIN_CALLS * budget_s or (len(times) >= MIN_CALLS and sum(times) >= budget_s):
            break
    return statistics.median(times)


class Parts(nn.Module):
    """The modules of one block and the head under their HF paths (model.layers.0, model.embed_tokens, model.norm,
    lm_head), so lora.py and quantized.py find them; `x` is the block's input, trainable so its gradient is
    computed as the layers below need it."""

    def __init__(self, req: ProbeRequest):
        super().__init__()
        spec = req.spec
        self.model = nn.Module()
        self.model.layers = [TransformerBlock(spec)]
        self.model.embed_tokens = Embedding(req.vocab_rows, spec.dim)
        self.model.norm = RMSNorm(spec.dim, eps=spec.norm_eps)
        if not spec.tie_embeddings:
            self.lm_head = Linear(spec.dim, req.vocab_rows, bias=False)
        self.x = mx.random.normal((req.rows, req.seq_len, spec.dim)).astype(getattr(mx, req.dtype))


def build(req: ProbeRequest) -> Parts:
    parts = Parts(req)
    if req.quantize[0]:  # a quantized base (QLoRA): its modules swapped before the adapters attach, as a rank does
        from .quantized import quantize_base

        quantize_base(parts, req.storage, req.probe_spec)
    attach(parts, req.trained, req.probe_spec)  # LoRA freezes all but the adapters; a full fine-tune trains all
    parts.unfreeze(recurse=False, keys=["x"])
    mx.eval(parts.parameters())
    return parts


def measure(req: ProbeRequest) -> dict:
    set_exp(req.exp)
    set_cross_entropy(req.cross_entropy)
    set_attention(probe_attention(req))
    parts = build(req)
    mask = attention_mask(None, req.seq_len)
    tokens = mx.random.randint(0, req.vocab_rows, (req.rows, req.seq_len))
    targets = mx.random.randint(0, req.vocab_rows, (req.rows, req.seq_len))

    def head(m: nn.Module) -> mx.array:
        h = m.norm(m.embed_tokens(tokens).astype(m.x.dtype) + m.x)
        logits = m.embed_tokens.as_linear(h) if req.spec.tie_embeddings else m.lm_head(h)
        return cross_entropy(logits.astype(mx.float32), targets).sum()

    def block_out(m: nn.Module) -> mx.array:
        return m.block(m.x, mask).astype(mx.float32).sum()

    figures: dict[str, float | None] = {}
    one = mx.array(1.0)
    for name, loss in (("block", block_out), ("head", head)):
        part = _holding(parts, name)  # only what the timed loss reads: MLX's gradient of the rest would be zeros
        forward, step = _compiled(part, loss, [part.state])
        figures[f"{name}_forward_s"] = timed(lambda: forward(one), req.budget_s)
        figures[f"{name}_step_s"] = timed(lambda: step(one), req.budget_s)
    figures.update(optimizer(req))
    figures["head_peak_bytes"] = held_at_peak_rss(lambda: mx.eval(step(one)))  # the head's (the loop's last)
    return {**figures, "framework": "mlx", "version": getattr(mx, "__version__", "?")}


def _holding(parts: Parts, name: str) -> nn.Module:
    """A module holding the same block ("block") or head modules ("head") as `parts`, and its input `x`: what one
    timing differentiates. Over all of `parts`, MLX's gradient gives every parameter the loss does not read a
    zeros array, written each call: under the block's timing the head's two vocabulary-sized matrices (100 MB each
    at `base`'s 32,768 rows x 768), which made the block's call 0.26 s longer whatever its rows, and `base`'s step
    predicted 33-64 % long (issue 56)."""
    part = nn.Module()
    if name == "block":
        part.block = parts.model.layers[0]
    else:
        part.embed_tokens, part.norm = parts.model.embed_tokens, parts.model.norm
        if "lm_head" in parts:
            part.lm_head = parts.lm_head
    part.x = parts.x
    return part


def _compiled(parts: nn.Module, loss: Callable[[nn.Module], mx.array], state: list) -> tuple[Callable, Callable]:
    """(forward, forward + backward) of `loss`, compiled over the parts' state as the step compiles its micro-step."""
    grad = nn.value_and_grad(parts, loss)

    def forward(scale: mx.array) -> mx.array:
        return loss(parts) * scale

    def step(scale: mx.array) -> object:
        return grad(parts)[1]
    return mx.compile(forward, inputs=state, outputs=state), mx.compile(step, inputs=state, outputs=state)


def optimizer(req: ProbeRequest) -> dict:
    """The step's update as step.py compiles it (ddp.py's global norm of grads.py's sums, the clip, AdamW) over
    the model's own trained tensors (ProbeRequest.optimizer_tensors): seconds per step for them."""
    sizes = req.optimizer_tensors()
    params = {"p": [mx.zeros((n,)) for n in sizes]}
    grads = {"p": [mx.ones((n,)) for n in sizes]}
    opt = optim.AdamW(learning_rate=1e-4, bias_correction=True)
    opt.init(params)
    mx.eval(params, grads, opt.state)
    holder = {"params": params}

    def update(g):
        norm = mx.sqrt(squares_of(x for _, x in tree_flatten(g)))
        return opt.apply_gradients(clip_by_norm(g, 1.0, norm), holder["params"])

    step = mx.compile(update, inputs=[opt.state], outputs=[opt.state])

    def once():
        holder["params"] = step(grads)
        return holder["params"]
    return {"optimizer_s": timed(once, req.budget_s), "optimizer_elements": sum(sizes)}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    req = read_request(args[0])
    print(RESULT_PREFIX + json.dumps(measure(req)), flush=True)
    return 0


if __name__ == "__main__":
    from common.train.process_exit import exit_now

    exit_now(main())  # no interpreter teardown: 1-1.5 s of a torch process (common/train/process_exit.py)
