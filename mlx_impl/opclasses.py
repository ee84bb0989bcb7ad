"""The op classes of common/train/opclasses.py as MLX workloads at a run's shapes, for the op-class profile
(common/train/opprofile.py). Mirrors torch_impl/opclasses.py name for name.

Each workload is the forward and the backward of its ops, as the training step runs them: the model's own
classes and functions (Linear, RMSNorm, RoPE, attention, silu_gate, token_loss_sum), layer 0's weights, random
inputs of the step's shapes in its compute dtype, `mx.vjp` under `mx.compile` (the step is compiled too), and
`mx.eval` of every output and gradient before the clock stops. Layers share their shapes, so one layer is timed
and counted n_layers times. The optimizer runs the Trainer's own AdamW on its own model, as the step's update
does (so, like the time breakdown's extra steps, it moves the weights after the run's last checkpoint).
"""
from __future__ import annotations

import functools
from typing import Callable

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map

from common.train.protocols import Batch

from .grads import clip_by_norm
from .model import Embedding, Linear, RMSNorm, attention, attention_mask, silu_gate, token_loss_sum

Workloads = dict[str, list[tuple[Callable[[], None], int]]]


def workloads(trainer, batch: Batch, grad_accum: int) -> Workloads:
    """{op class: [(run once and wait, times per optimizer step)]} at `batch`'s shapes."""
    model = trainer.model
    spec, inner = model.spec, model.model
    dtype, layer = inner.compute_dtype, inner.layers[0]
    inputs, targets, mask = batch
    B, T = inputs.shape
    H, KV, hd, d, F = spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.dim, spec.ffn_dim
    normal = _normal(dtype)
    attn, mlp = layer.self_attn, layer.mlp
    projections = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    linear = Linear(1, 1, bias=False)  # a shell: the weight under test is swapped in (never evaluated)

    def matmuls(x, a, h, *weights):  # a layer's projections: q, k, v and gate, up read x; o reads a, down h
        sources = (x, x, x, a, x, x, h)
        return [_with_weight(linear, w)(s) for s, w in zip(sources, weights)]

    layer_matmuls = _vjp(matmuls, [normal(B, T, d), normal(B, T, H * hd), normal(B, T, F),
                                   *(p.weight for p in projections)])
    head = Embedding(1, 1) if spec.tie_embeddings else linear
    head_weight = inner.embed_tokens.weight if spec.tie_embeddings else model.lm_head.weight
    head_call = (lambda x, w: [_with_weight(head, w).as_linear(x)]) if spec.tie_embeddings else \
        (lambda x, w: [_with_weight(head, w)(x)])
    head_matmul = _vjp(head_call, [normal(B, T, d), head_weight])

    mask_kind = attention_mask(None, T)

    def core_of(q, k, v):  # as Attention.__call__: v split into heads, the output merged back
        out = attention(q, k, v.transpose(0, 2, 1, 3), attn.scale, mask_kind)
        return [out.transpose(0, 2, 1, 3).reshape(B, T, -1)]

    core = _vjp(core_of, [normal(B, H, T, hd), normal(B, KV, T, hd), normal(B, T, KV, hd)])

    t, m = mx.array(targets), mx.array(mask)
    loss = _vjp(lambda logits: [token_loss_sum(lambda _: logits, None, t, m)[0]], [normal(B, T, spec.vocab_size)])

    norm = RMSNorm(1, eps=spec.norm_eps)  # a shell, as `linear`

    def elementwise(x, h, q, k, gate, up, w1, w2):  # RoPE of q and k as split into heads, as Attention.__call__
        return [_with_weight(norm, w1)(x), _with_weight(norm, w2)(h), attn.rope(q.transpose(0, 2, 1, 3)),
                attn.rope(k.transpose(0, 2, 1, 3)), silu_gate(gate, up)]

    layer_elementwise = _vjp(elementwise, [normal(B, T, d), normal(B, T, d), normal(B, T, H, hd), normal(B, T, KV, hd),
                                           normal(B, T, F), normal(B, T, F), layer.input_layernorm.weight,
                                           layer.post_attention_layernorm.weight])
    final_norm = _vjp(lambda x, w: [_with_weight(norm, w)(x)], [normal(B, T, d), inner.norm.weight])

    L = spec.n_layers
    return {"matmul": [(layer_matmuls, L * grad_accum), (head_matmul, grad_accum)],
            "attention": [(core, L * grad_accum)],
            "softmax/cross-entropy": [(loss, grad_accum)],
            "norms/activations/RoPE": [(layer_elementwise, L * grad_accum), (final_norm, grad_accum)],
            "optimizer": [(_update(trainer), 1)]}


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


def _with_weight(module, weight: mx.array):
    module.weight = weight
    return module


def _vjp(fn: Callable[..., list[mx.array]], primals: list[mx.array]) -> Callable[[], None]:
    """fn's forward and backward, compiled, with random cotangents of its outputs' shapes: run and wait."""
    mx.eval(primals)
    outputs = fn(*primals)
    cotangents = [_normal(o.dtype)(*o.shape) if o.ndim else mx.array(1.0, dtype=o.dtype) for o in outputs]
    mx.eval(cotangents)
    passes = mx.compile(lambda p, c: mx.vjp(fn, p, c))
    return lambda: mx.eval(passes(primals, cotangents))


def _update(trainer) -> Callable[[], None]:
    """The step's update (mlx_impl/step.py): the global norm, the clip and AdamW over the Trainer's own model and
    optimizer, with constant gradients of every parameter's shape."""
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
