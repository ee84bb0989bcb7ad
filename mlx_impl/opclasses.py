"""The op classes of common/train/opclasses.py as MLX workloads at a run's shapes, for the op-class profile
(common/train/opprofile.py). Mirrors torch_impl/opclasses.py name for name.

Each workload is the forward and the backward of its ops, as the training step runs them: the model's own
modules (copies of one block's Linear and RMSNorm, with LoRA's adapters or a quantized base where the run has them)
and functions (RoPE, attention, silu_gate, token_loss_sum), random inputs of the step's shapes in its compute
dtype, `mx.vjp` under `mx.compile` (the step is compiled too) for the inputs and what trains of each module (a
frozen base gets no gradient, as in the step), and `mx.eval` of every output and gradient before the clock stops.
Layers share their shapes, so one layer is timed and counted n_layers times; under LoRA on the last blocks only
(--lora-layers) the lowest adapted block is timed, and the blocks below it run their forward alone, as the step
runs them. The optimizer runs the Trainer's own AdamW on its own model's trained parameters, as the step's update
does (so, like the time breakdown's extra steps, it moves the weights after the run's last checkpoint).
"""
from __future__ import annotations

import copy
import functools
from typing import Callable

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map

from common.train.protocols import Batch

from .grads import clip_by_norm
from .model import attention, attention_mask, silu_gate, token_loss_sum

Workloads = dict[str, list[tuple[Callable[[], None], int]]]


def workloads(trainer, batch: Batch, grad_accum: int) -> Workloads:
    """{op class: [(run once and wait, times per optimizer step)]} at `batch`'s shapes."""
    model = trainer.model
    spec, inner = model.spec, model.model
    L, back = spec.n_layers, len(trainer.trained.blocks(spec))  # the blocks the backward runs through
    dtype, layer, below = inner.compute_dtype, inner.layers[L - back], inner.layers[0]  # LoRA's adapters sit in
    # the first; the second is a block below them where --lora-layers leaves some (forward alone)
    inputs, targets, mask = batch
    B, T = inputs.shape
    H, KV, hd, d, F = spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.dim, spec.ffn_dim
    normal = _normal(dtype)
    attn = layer.self_attn

    def matmuls(x, a, h, *projected):  # a layer's projections: q, k, v and gate, up read x; o reads a, down h
        return [p(s) for s, p in zip((x, x, x, a, x, x, h), projected)]

    layer_matmuls = _per_layer(matmuls, [normal(B, T, d), normal(B, T, H * hd), normal(B, T, F)],
                               _projections(layer), _projections(below), back, L, grad_accum)
    head = inner.embed_tokens if spec.tie_embeddings else model.lm_head
    head_matmul = _vjp(lambda x, h: [h.as_linear(x) if spec.tie_embeddings else h(x)], [normal(B, T, d)], [head])

    mask_kind = attention_mask(None, T)

    def core_of(q, k, v):  # as Attention.__call__: v split into heads, the output merged back
        out = attention(q, k, v.transpose(0, 2, 1, 3), attn.scale, mask_kind)
        return [out.transpose(0, 2, 1, 3).reshape(B, T, -1)]

    core = _per_layer(core_of, [normal(B, H, T, hd), normal(B, KV, T, hd), normal(B, T, KV, hd)], [], [], back, L,
                      grad_accum)

    t, m = mx.array(targets), mx.array(mask)
    loss = _vjp(lambda logits: [token_loss_sum(lambda _: logits, None, t, m)[0]], [normal(B, T, spec.vocab_size)], [])

    def elementwise(x, h, q, k, gate, up, norm1, norm2):  # RoPE of q and k as split into heads, as Attention.__call__
        return [norm1(x), norm2(h), attn.rope(q.transpose(0, 2, 1, 3)), attn.rope(k.transpose(0, 2, 1, 3)),
                silu_gate(gate, up)]

    layer_elementwise = _per_layer(elementwise, [normal(B, T, d), normal(B, T, d), normal(B, T, H, hd),
                                                 normal(B, T, KV, hd), normal(B, T, F), normal(B, T, F)],
                                   [layer.input_layernorm, layer.post_attention_layernorm],
                                   [below.input_layernorm, below.post_attention_layernorm], back, L, grad_accum)
    final_norm = _vjp(lambda x, norm: [norm(x)], [normal(B, T, d)], [inner.norm])

    return {"matmul": layer_matmuls + [(head_matmul, grad_accum)],
            "attention": core,
            "softmax/cross-entropy": [(loss, grad_accum)],
            "norms/activations/RoPE": layer_elementwise + [(final_norm, grad_accum)],
            "optimizer": [(_update(trainer), 1)]}


def _projections(block) -> list:
    a, m = block.self_attn, block.mlp
    return [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj]


def _per_layer(fn, inputs: list[mx.array], modules: list, below: list, back: int, layers: int, grad_accum: int):
    """A layer's workload over `modules` in each of the `back` blocks the backward runs through, and its forward
    alone over `below` in the blocks under them (LoRA's lowest blocks without adapters: the step differentiates
    nothing there)."""
    parts = [(_vjp(fn, inputs, modules), back * grad_accum)]
    if layers > back:
        parts.append((_forward(fn, inputs, below), (layers - back) * grad_accum))
    return parts


def _normal(dtype):
    """Random inputs from numpy's generator, as in torch_impl/opclasses.py (MLX's own normal takes ~0.1 s per
    million values on a CPU, most of the profile's cost at demo shapes)."""
    pool = _pool()

    def normal(*shape: int) -> mx.array:
        return mx.array(pool.take(shape)).astype(dtype)
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


def _trained(module) -> dict[str, mx.array]:
    """What the step differentiates of a module: its weight where every parameter trains, LoRA's adapters where
    they sit, nothing of a frozen base. A bias is left out: its add is no matmul (nor norm) work."""
    return {k: v for k, v in module.trainable_parameters().items() if isinstance(v, mx.array) and k != "bias"}


def _shells(modules: list) -> tuple[list, Callable[[list[mx.array]], None]]:
    """Copies of the model's own `modules` (their classes, arrays and LoRA scale: what the step calls), and
    put(arrays) that swaps the trained arrays in (the vjp's primals), so the model itself is never touched."""
    shells = [copy.copy(m) for m in modules]
    names = [list(_trained(m)) for m in modules]

    def put(arrays: list[mx.array]) -> None:
        given = iter(arrays)
        for shell, keys in zip(shells, names):
            shell.update({k: next(given) for k in keys})
    return shells, put


def _vjp(fn: Callable[..., list[mx.array]], inputs: list[mx.array], modules: list) -> Callable[[], None]:
    """fn(*inputs, *modules)'s forward and backward, compiled, with random cotangents of its outputs' shapes,
    differentiated for the inputs and the modules' trained arrays: run and wait."""
    shells, put = _shells(modules)
    primals = inputs + [v for m in modules for v in _trained(m).values()]

    def passes(*arrays: mx.array) -> list[mx.array]:
        put(list(arrays[len(inputs):]))
        return fn(*arrays[:len(inputs)], *shells)

    mx.eval(primals)
    outputs = passes(*primals)
    cotangents = [_normal(o.dtype)(*o.shape) if o.ndim else mx.array(1.0, dtype=o.dtype) for o in outputs]
    mx.eval(cotangents)
    compiled = mx.compile(lambda p, c: mx.vjp(passes, p, c))
    return lambda: mx.eval(compiled(primals, cotangents))


def _forward(fn: Callable[..., list[mx.array]], inputs: list[mx.array], modules: list) -> Callable[[], None]:
    """fn(*inputs, *modules)'s forward alone, compiled: run and wait."""
    mx.eval(inputs)
    compiled = mx.compile(lambda *xs: fn(*xs, *modules))
    return lambda: mx.eval(compiled(*inputs))


def _update(trainer) -> Callable[[], None]:
    """The step's update (mlx_impl/step.py): the global norm, the clip and AdamW over the Trainer's own model and
    optimizer, with constant gradients of every trained parameter's shape (LoRA: the adapters')."""
    model, optimizer, strategy = trainer.model, trainer.optimizer, trainer.strategy
    grads = tree_map(lambda p: mx.full(p.shape, 1e-3, dtype=p.dtype), model.trainable_parameters())
    mx.eval(grads)

    def update(grads):
        norm = strategy.global_norm(grads)
        if trainer.grad_clip > 0:
            grads = clip_by_norm(grads, trainer.grad_clip, norm)
        optimizer.update(model, grads)
        return norm

    state = [model.state, optimizer.state]
    compiled = mx.compile(update, inputs=state, outputs=state)
    return lambda: mx.eval(compiled(grads), model.state, optimizer.state)
