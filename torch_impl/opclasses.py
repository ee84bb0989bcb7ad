"""The op classes of common/train/opclasses.py as torch workloads at a run's shapes, for the op-class profile
(common/train/opprofile.py). Mirrors mlx_impl/opclasses.py name for name.

Each workload is the forward and the backward of its ops, as the training step runs them: the model's own
modules and functions (layer 0's Linear, RMSNorm and RoPE modules, attention, silu_gate, token_loss_sum), random
inputs of the step's shapes in its compute dtype, `torch.autograd.grad` with random cotangents (nothing lands in
the parameters' .grad), and a device sync (CUDA, MPS) before the clock stops. Layers share their shapes, so one
layer is timed and counted n_layers times. The optimizer runs the Trainer's own AdamW on its own model, as the
step's update does (so, like the time breakdown's extra steps, it moves the weights after the run's last
checkpoint). Timed directly rather than with torch.profiler, so that both frameworks are measured the same way.
"""
from __future__ import annotations

import functools
from typing import Callable

import numpy as np
import torch

from common.train.protocols import Batch

from .grads import clip_by_norm
from .microsteps import to_device, wait_for
from .model import attention, attention_mask, silu_gate, token_loss_sum

Workloads = dict[str, list[tuple[Callable[[], None], int]]]


def workloads(trainer, batch: Batch, grad_accum: int) -> Workloads:
    """{op class: [(run once and wait, times per optimizer step)]} at `batch`'s shapes."""
    model, device = trainer.model, trainer.device
    spec, inner = model.spec, model.model
    dtype, layer = inner.compute_dtype, inner.layers[0]
    inputs, targets, mask = to_device(device, *batch)
    B, T = inputs.shape
    H, KV, hd, d, F = spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.dim, spec.ffn_dim
    normal = _normal(dtype, device)
    attn, mlp = layer.self_attn, layer.mlp
    projections = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]

    def matmuls(x, a, h):  # a layer's projections: q, k, v and gate, up read x; o reads a, down h
        return [p(s) for s, p in zip((x, x, x, a, x, x, h), projections)]

    layer_matmuls = _vjp(matmuls, [normal(B, T, d), normal(B, T, H * hd), normal(B, T, F)],
                         [p.weight for p in projections], device)
    head = inner.embed_tokens.as_linear if spec.tie_embeddings else model.lm_head
    head_weight = inner.embed_tokens.weight if spec.tie_embeddings else model.lm_head.weight
    head_matmul = _vjp(lambda x: [head(x)], [normal(B, T, d)], [head_weight], device)

    mask_kind = attention_mask(None, T)

    def core_of(q, k, v):  # as Attention.forward: v split into heads, the output merged back
        out = attention(q, k, v.transpose(1, 2), attn.scale, mask_kind)
        return [out.transpose(1, 2).reshape(B, T, -1)]

    core = _vjp(core_of, [normal(B, H, T, hd), normal(B, KV, T, hd), normal(B, T, KV, hd)], [], device)

    loss = _vjp(lambda logits: [token_loss_sum(lambda _: logits, None, targets, mask)],
                [normal(B, T, spec.vocab_size)], [], device)

    def elementwise(x, h, q, k, gate, up):  # RoPE of q and k as split into heads, as Attention.forward
        return [layer.input_layernorm(x), layer.post_attention_layernorm(h), attn.rope(q.transpose(1, 2)),
                attn.rope(k.transpose(1, 2)), silu_gate(gate, up)]

    layer_elementwise = _vjp(elementwise, [normal(B, T, d), normal(B, T, d), normal(B, T, H, hd), normal(B, T, KV, hd),
                                           normal(B, T, F), normal(B, T, F)],
                             [layer.input_layernorm.weight, layer.post_attention_layernorm.weight], device)
    final_norm = _vjp(lambda x: [inner.norm(x)], [normal(B, T, d)], [inner.norm.weight], device)

    L = spec.n_layers
    return {"matmul": [(layer_matmuls, L * grad_accum), (head_matmul, grad_accum)],
            "attention": [(core, L * grad_accum)],
            "softmax/cross-entropy": [(loss, grad_accum)],
            "norms/activations/RoPE": [(layer_elementwise, L * grad_accum), (final_norm, grad_accum)],
            "optimizer": [(_update(trainer), 1)]}


def _normal(dtype: torch.dtype, device: torch.device):
    """Random inputs from numpy's generator, as in mlx_impl/opclasses.py."""
    pool = _pool()

    def normal(*shape: int) -> torch.Tensor:
        return torch.from_numpy(pool.take(shape)).to(device=device, dtype=dtype)
    return normal


@functools.cache
def _pool() -> "_Pool":
    return _Pool()


class _Pool:
    """A million normal values (scaled by 0.5), drawn once and repeated to fill each array: the values do not
    matter to the timing, and drawing `small`'s 100 million logits alone took seconds."""

    def __init__(self, size: int = 1 << 20):
        self.values = np.random.default_rng(0).standard_normal(size, dtype=np.float32) * np.float32(0.5)

    def take(self, shape: tuple[int, ...]) -> np.ndarray:
        return np.resize(self.values, shape)


def _vjp(fn: Callable[..., list[torch.Tensor]], inputs: list[torch.Tensor], weights: list[torch.Tensor],
         device: torch.device) -> Callable[[], None]:
    """fn's forward and backward, with random cotangents of its outputs' shapes (gradients of the inputs and of
    `weights`, the module parameters it uses): run and wait."""
    inputs = [x.requires_grad_() for x in inputs]
    with torch.no_grad():
        outputs = fn(*inputs)
    cotangents = [_normal(o.dtype, device)(*o.shape) if o.ndim else torch.ones((), dtype=o.dtype, device=device)
                  for o in outputs]

    def passes() -> None:
        torch.autograd.grad(fn(*inputs), inputs + weights, cotangents)
        wait_for(True, device)
    return passes


def _update(trainer) -> Callable[[], None]:
    """The step's update (torch_impl/step.py): the global norm, the clip and AdamW over the Trainer's own model and
    optimizer, with constant gradients of every parameter's shape."""
    model, optimizer, strategy = trainer.model, trainer.optimizer, trainer.strategy
    params = [p for p in model.parameters()]
    grads = [torch.full_like(p, 1e-3) for p in params]

    def update() -> None:
        for p, g in zip(params, grads):  # the step's backward leaves them there; not this class's work
            if p.grad is None:
                p.grad = g
            else:
                p.grad.copy_(g)
        held = [p.grad for p in params]
        norm = strategy.global_norm(held)
        if trainer.grad_clip > 0:
            clip_by_norm(held, trainer.grad_clip, norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=not strategy.keeps_grads)
        norm.item()  # waits for the device, as the step's grad_norm.item() does
    return update
