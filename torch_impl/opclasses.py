"""The op classes of common/train/opclasses.py as torch workloads at a run's shapes, for the op-class profile
(common/train/opprofile.py). Mirrors mlx_impl/opclasses.py name for name.

Each workload is the forward and the backward of its ops, as the training step runs them: the model's own
modules (one block's Linear, RMSNorm and RoPE, with LoRA's adapters or a quantized base where the run has them) and
functions (attention, silu_gate, token_loss_sum), random inputs of the step's shapes in its compute dtype,
`torch.autograd.grad` with random cotangents for the inputs and what trains of each module (a frozen base gets
no gradient, as in the step; nothing lands in the parameters' .grad), and a device sync (CUDA, MPS) before the
clock stops. Layers share their shapes, so one layer is timed and counted n_layers times; under LoRA on the last
blocks only (--lora-layers) the lowest adapted block is timed, and the blocks below it run their forward alone,
as the step runs them. The optimizer runs the Trainer's own AdamW on its own model's trained parameters, as the
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
    L, back = spec.n_layers, len(trainer.trained.blocks(spec))  # the blocks the backward runs through
    dtype, layer, below = inner.compute_dtype, inner.layers[L - back], inner.layers[0]  # LoRA's adapters sit in
    # the first; the second is a block below them where --lora-layers leaves some (forward alone)
    inputs, targets, mask = to_device(device, *batch)
    B, T = inputs.shape
    H, KV, hd, d, F = spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.dim, spec.ffn_dim
    normal = _normal(dtype, device)
    attn = layer.self_attn

    def matmuls(x, a, h, *projected):  # a layer's projections: q, k, v and gate, up read x; o reads a, down h
        return [p(s) for s, p in zip((x, x, x, a, x, x, h), projected)]

    layer_matmuls = _per_layer(matmuls, [normal(B, T, d), normal(B, T, H * hd), normal(B, T, F)],
                               _projections(layer), _projections(below), back, L, grad_accum, device)
    head = inner.embed_tokens if spec.tie_embeddings else model.lm_head
    head_matmul = _vjp(lambda x, h: [h.as_linear(x) if spec.tie_embeddings else h(x)], [normal(B, T, d)], [head],
                       device)

    mask_kind = attention_mask(None, T)

    def core_of(q, k, v):  # as Attention.forward: v split into heads, the output merged back
        out = attention(q, k, v.transpose(1, 2), attn.scale, mask_kind)
        return [out.transpose(1, 2).reshape(B, T, -1)]

    core = _per_layer(core_of, [normal(B, H, T, hd), normal(B, KV, T, hd), normal(B, T, KV, hd)], [], [], back, L,
                      grad_accum, device)

    loss = _vjp(lambda logits: [token_loss_sum(lambda _: logits, None, targets, mask)],
                [normal(B, T, spec.vocab_size)], [], device)

    def elementwise(x, h, q, k, gate, up, norm1, norm2):  # RoPE of q and k as split into heads, as Attention.forward
        return [norm1(x), norm2(h), attn.rope(q.transpose(1, 2)), attn.rope(k.transpose(1, 2)), silu_gate(gate, up)]

    layer_elementwise = _per_layer(elementwise, [normal(B, T, d), normal(B, T, d), normal(B, T, H, hd),
                                                 normal(B, T, KV, hd), normal(B, T, F), normal(B, T, F)],
                                   [layer.input_layernorm, layer.post_attention_layernorm],
                                   [below.input_layernorm, below.post_attention_layernorm], back, L, grad_accum,
                                   device)
    final_norm = _vjp(lambda x, norm: [norm(x)], [normal(B, T, d)], [inner.norm], device)

    return {"matmul": layer_matmuls + [(head_matmul, grad_accum)],
            "attention": core,
            "softmax/cross-entropy": [(loss, grad_accum)],
            "norms/activations/RoPE": layer_elementwise + [(final_norm, grad_accum)],
            "optimizer": [(_update(trainer), 1)]}


def _projections(block) -> list:
    a, m = block.self_attn, block.mlp
    return [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj]


def _per_layer(fn, inputs: list[torch.Tensor], modules: list, below: list, back: int, layers: int, grad_accum: int,
               device: torch.device):
    """A layer's workload over `modules` in each of the `back` blocks the backward runs through, and its forward
    alone over `below` in the blocks under them (LoRA's lowest blocks without adapters: the step differentiates
    nothing there)."""
    parts = [(_vjp(fn, inputs, modules, device), back * grad_accum)]
    if layers > back:
        parts.append((_forward(fn, inputs, below, device), (layers - back) * grad_accum))
    return parts


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


def _trained(module) -> dict[str, torch.Tensor]:
    """What the step differentiates of a module: its weight where every parameter trains, LoRA's adapters where
    they sit, nothing of a frozen base. A bias is left out: its add is no matmul (nor norm) work."""
    return {k: p for k, p in module.named_parameters(recurse=False) if p.requires_grad and k != "bias"}


def _vjp(fn: Callable[..., list[torch.Tensor]], inputs: list[torch.Tensor], modules: list,
         device: torch.device) -> Callable[[], None]:
    """fn(*inputs, *modules)'s forward and backward, with random cotangents of its outputs' shapes, differentiated
    for the inputs and the modules' trained parameters: run and wait."""
    inputs = [x.requires_grad_() for x in inputs]
    weights = [p for m in modules for p in _trained(m).values()]
    with torch.no_grad():
        outputs = fn(*inputs, *modules)
    cotangents = [_normal(o.dtype, device)(*o.shape) if o.ndim else torch.ones((), dtype=o.dtype, device=device)
                  for o in outputs]

    def passes() -> None:
        torch.autograd.grad(fn(*inputs, *modules), inputs + weights, cotangents)
        wait_for(True, device)
    return passes


def _forward(fn: Callable[..., list[torch.Tensor]], inputs: list[torch.Tensor], modules: list,
             device: torch.device) -> Callable[[], None]:
    """fn(*inputs, *modules)'s forward alone: run and wait."""
    def passes() -> None:
        with torch.no_grad():
            fn(*inputs, *modules)
        wait_for(True, device)
    return passes


def _update(trainer) -> Callable[[], None]:
    """The step's update (torch_impl/step.py): the global norm, the clip and AdamW over the Trainer's own model and
    optimizer, with constant gradients of every trained parameter's shape (LoRA: the adapters')."""
    model, optimizer, strategy = trainer.model, trainer.optimizer, trainer.strategy
    params = [p for p in model.parameters() if p.requires_grad]
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
