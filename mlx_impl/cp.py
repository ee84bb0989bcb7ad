"""Context parallelism in MLX (`--strategy cp`, `--mesh dp=2,cp=2`): each rank keeps its slice of the sequence
outside attention, and Ulysses's all-to-alls give attention the whole sequence for heads / cp of the heads. The split
and its cost: common/parallel/cp.py. Mirrors torch_impl/cp.py.

MLX has no all-to-all (FACTS.md): `seq_to_heads` all-gathers the rank's (B, H, T/cp, D) and keeps its heads of every
slice; `heads_to_seq` all-gathers the output (B, H/cp, T, D) and keeps its slice of every head group. Each is the
other's gradient (custom_function: MLX's own all_gather vjp slices the cotangent, right only where the downstream is
replicated). The cost against a real all-to-all: cp times its bytes on the wire ((cp-1) T/cp of the tensor instead of
(cp-1)/cp^2 of it) and a moment's cp x the tensor in memory; at cp=2, 2x. Send/recv would carry only the other
rank's part at cp=2, but on the ring backend MLX reorders independent sends (FACTS.md), so each would be evaluated on
its own, outside the compiled step: not built.

The strategy is ddp's (`Replicated`) over every rank of the job: each rank's gradients are those of its own tokens,
scaled by cp so that the average over dp x cp ranks is the gradient of the step's loss; the loss sums over the world.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from common.checkpoint.tensorsource import TensorSource
from common.config import RunConfig
from common.parallel.cp import positions_for, ring_blocks
from common.train.protocols import Batch, ForwardBackwardResult, Phase, World, no_phase

from .comm import CommCounter
from .ddp import Replicated
from .microsteps import Grads, Losses, StepFunctions
from .model import Attention, _rope_arrays, attention

Exchange = Callable[[mx.array], mx.array]  # mx.custom_function: called as one


def ulysses_exchanges(group, rank: int, size: int, comm: CommCounter | None = None) -> tuple[Exchange, Exchange]:
    """(seq_to_heads, heads_to_seq) over `group`, as all-gathers (the module docstring): (B, H, T/n, D) ->
    (B, H/n, T, D) and back, each the other's vjp."""
    n = size

    @mx.custom_function
    def seq_to_heads(x):
        B, H, Tl, D = x.shape
        if comm is not None:
            comm.add(x)
        gathered = mx.distributed.all_gather(x, group=group)  # (n B, H, Tl, D): slice i from rank i
        mine = gathered.reshape(n, B, n, H // n, Tl, D)[:, :, rank]  # (n, B, H/n, Tl, D): this rank's heads
        return mine.transpose(1, 2, 0, 3, 4).reshape(B, H // n, n * Tl, D)

    @mx.custom_function
    def heads_to_seq(y):
        B, Hc, T, D = y.shape
        if comm is not None:
            comm.add(y)
        gathered = mx.distributed.all_gather(y, group=group)  # (n B, H/n, T, D): head group i from rank i
        mine = gathered.reshape(n, B, Hc, n, T // n, D)[:, :, :, rank]  # (n, B, H/n, T/n, D): this rank's slice
        return mine.transpose(1, 0, 2, 3, 4).reshape(B, n * Hc, T // n, D)

    @seq_to_heads.vjp
    def seq_to_heads_vjp(x, dy, _):
        return heads_to_seq(dy)

    @heads_to_seq.vjp
    def heads_to_seq_vjp(y, dx, _):
        return seq_to_heads(dx)

    return cast(Exchange, seq_to_heads), cast(Exchange, heads_to_seq)


def ring_passes(group, rank: int, size: int, comm: CommCounter | None = None) -> Exchange:
    """The ring's step: the block of the rank before this one in the cp group, its gradient sent back the other
    way. Built on all_gather (each rank keeps its predecessor's part): at cp=2 the same bytes a send/recv pair
    carries; at cp > 2 cp - 1 times them. MLX's send and recv inside the compiled step cannot be ordered (the
    graph runs independent ones in any order, FACTS.md), and two ranks that both receive first deadlock."""
    n = size

    def taken(x: mx.array, source: int) -> mx.array:
        if comm is not None:
            comm.add(x)
        return mx.distributed.all_gather(x[None], group=group)[source]

    @mx.custom_function
    def from_previous(x):
        return taken(x, (rank - 1) % n)

    @mx.custom_function
    def from_next(x):
        return taken(x, (rank + 1) % n)

    @from_previous.vjp
    def from_previous_vjp(x, dy, _):
        return from_next(dy)

    @from_next.vjp
    def from_next_vjp(x, dy, _):
        return from_previous(dy)

    return cast(Exchange, from_previous)


def block_attention(q: mx.array, k: mx.array, v: mx.array, scale: float,
                    bias: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """(softmax(q k^T scale + bias) v, its rows' logsumexp) in float32, (B, H, t, D) queries against (B, KV, s, D)
    keys and values (grouped-query: each kv head repeated for its query heads)."""
    q, k, v = q.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32)
    if k.shape[1] != q.shape[1]:
        k, v = mx.repeat(k, q.shape[1] // k.shape[1], axis=1), mx.repeat(v, q.shape[1] // v.shape[1], axis=1)
    scores = (q * scale) @ k.swapaxes(-1, -2)
    if bias is not None:
        scores = scores + bias
    peak = mx.stop_gradient(scores.max(axis=-1, keepdims=True))
    e = mx.exp(scores - peak)
    rows = e.sum(axis=-1, keepdims=True)
    return (e @ v) / rows, peak + mx.log(rows)


def merged(out: mx.array, lse: mx.array, block_out: mx.array, block_lse: mx.array) -> tuple[mx.array, mx.array]:
    """The online softmax's step: two partial attentions of the same queries over disjoint keys, as one."""
    both = mx.logaddexp(lse, block_lse)
    return out * mx.exp(lse - both) + block_out * mx.exp(block_lse - both), both


def ring_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, rank: int, size: int,
                   from_previous: Exchange) -> mx.array:
    """Causal attention of the rank's zig-zag chunks (q, k, v: (B, heads, 2c, D), positions common/parallel/cp.py
    zigzag_positions) over the whole sequence: its own block under the causal mask, then cp - 1 times the key/value
    block of the rank before passed on, each merged into the chunks' running (output, logsumexp), the half of each
    block that lies wholly in the future skipped (ring_blocks)."""
    c = q.shape[2] // 2
    positions = positions_for("ring", 2 * c * size, rank, size)
    bias = mx.array(np.where(positions[:, None] >= positions[None], 0.0, -np.inf).astype(np.float32))
    out, lse = block_attention(q, k, v, scale, bias)
    first, second = (out[:, :, :c], lse[:, :, :c]), (out[:, :, c:], lse[:, :, c:])
    kv = mx.stack([k, v])
    for step in range(1, size):
        kv = from_previous(kv)
        if ring_blocks(rank, (rank - step) % size) == "first":
            block_out, block_lse = block_attention(q, kv[0][:, :, :c], kv[1][:, :, :c], scale)
            first = merged(*first, block_out[:, :, :c], block_lse[:, :, :c])
            second = merged(*second, block_out[:, :, c:], block_lse[:, :, c:])
        else:
            second = merged(*second, *block_attention(q[:, :, c:], kv[0], kv[1], scale))
    return mx.concatenate([first[0], second[0]], axis=2).astype(q.dtype)


class UlyssesAttention(Attention):
    """The block's attention on the rank's slice: q, k, v of its tokens rotated at their global positions, the
    all-to-alls around the whole-length core, o_proj on its tokens. The projections are the block's own modules."""

    @classmethod
    def from_attention(cls, attn: Attention, rank: int, size: int, exchanges: Any):
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.n_heads, layer.n_kv_heads, layer.scale = attn.n_heads, attn.n_kv_heads, attn.scale
        layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        layer.rope = attn.rope
        layer._cp = (rank, size, exchanges)
        return layer

    def __call__(self, x: mx.array, mask: mx.array | str) -> mx.array:
        rank, size, (seq_to_heads, heads_to_seq) = self._cp
        B, Tl, _ = x.shape
        q = self.q_proj(x).reshape(B, Tl, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, Tl, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, Tl, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        positions = mx.array(positions_for("ulysses", Tl * size, rank, size))
        q, k = rope_at(self.rope, q, positions, Tl * size), rope_at(self.rope, k, positions, Tl * size)
        out = attention(seq_to_heads(q), seq_to_heads(k), seq_to_heads(v), self.scale, "causal")
        return self.o_proj(heads_to_seq(out).transpose(0, 2, 1, 3).reshape(B, Tl, -1))


class RingAttention(UlyssesAttention):
    """The block's attention on the rank's zig-zag chunks: q, k, v rotated at their global positions, ring_attention
    over the cp group (`from_previous` in place of Ulysses's exchanges), o_proj on its tokens."""

    def __call__(self, x: mx.array, mask: mx.array | str) -> mx.array:
        rank, size, from_previous = self._cp
        B, Tl, _ = x.shape
        q = self.q_proj(x).reshape(B, Tl, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, Tl, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, Tl, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        positions = mx.array(positions_for("ring", Tl * size, rank, size))
        q, k = rope_at(self.rope, q, positions, Tl * size), rope_at(self.rope, k, positions, Tl * size)
        out = ring_attention(q, k, v, self.scale, rank, size, from_previous)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, Tl, -1))


def rope_at(rope: nn.Module, x: mx.array, positions: mx.array, seq_len: int) -> mx.array:
    """model.py's RoPE of (B, H, t, D) tokens at global `positions` of a sequence of `seq_len`."""
    cos, sin = _rope_arrays(rope.spec, seq_len)
    cos, sin = cos[positions].astype(x.dtype), sin[positions].astype(x.dtype)
    x1, x2 = mx.split(x, 2, axis=-1)
    return x * cos + mx.concatenate([-x2, x1], axis=-1) * sin


def exchanges_for(attention: str, group: Any, rank: int, size: int, comm: CommCounter | None = None) -> Any:
    """--cp-attention's exchanges over the cp group: ring's pass from the previous rank, or Ulysses's pair."""
    return (ring_passes(group, rank, size, comm) if attention == "ring" else
            ulysses_exchanges(group, rank, size, comm))


def sequence_attention(model: Any, attention: str, rank: int, size: int, exchanges: Any) -> None:
    """Every block's attention, in place, as the cp rank's (before a model axis splits or keeps the blocks: the
    projections stay the block's own modules, so tp's plan and pp's stages see the same names). No release_heap
    (torch's twin gives glibc's freed heap back as each block's attention ends): MLX's step takes its
    buffers from its own allocator's cache, whose peak cp_memory.py reads apart (0.50 of ddp x1's at cp=2)."""
    kind = RingAttention if attention == "ring" else UlyssesAttention
    for block in model.model.layers:
        block.self_attn = kind.from_attention(block.self_attn, rank, size, exchanges)


def sequence_slices(batches: Sequence[Batch], attention: str, rank: int, size: int) -> list[Batch]:
    """The cp rank's positions of each micro-batch's (inputs, targets, mask)."""
    out = []
    for inputs, targets, mask in batches:
        mine = positions_for(attention, inputs.shape[1], rank, size)
        out.append((inputs[:, mine], targets[:, mine], mask[:, mine]))
    return out


class SequenceParallel(Replicated):
    """The cp strategy (common/train/protocols.py), alone or beside dp: ddp over every rank of the job, each rank
    on its slice of the rows its data rank reads."""

    loss_over = "world"  # every rank holds the token losses of its own slice

    def __init__(self, cfg: RunConfig, world: World, comm: CommCounter):
        super().__init__(cfg, world, comm)
        self.dp_size = world.size  # the gradients averaged over dp x cp (communicates)
        cp = world.axes.get("cp", world)
        self.cp_rank, self.cp_size = cp.rank, cp.size
        self.attention = cfg.cp_attention
        self.exchanges = exchanges_for(self.attention, cp.group, cp.rank, cp.size, comm)

    def wrap(self, model: nn.Module, source: TensorSource) -> nn.Module:
        sequence_attention(model, self.attention, self.cp_rank, self.cp_size, self.exchanges)
        return super().wrap(model, source)

    def sliced(self, batches: Sequence[Batch]) -> list[Batch]:
        """This rank's positions of each micro-batch's (inputs, targets, mask)."""
        return sequence_slices(batches, self.attention, self.cp_rank, self.cp_size)

    def forward_backward(self, step: StepFunctions, batches: Sequence[Batch], scale: float,
                         phase: Phase = no_phase, wait: bool = False,
                         sync: bool = True) -> ForwardBackwardResult[Losses, Grads]:
        """Scaled by cp: the average over dp x cp ranks is then the step's gradient (the module docstring)."""
        return super().forward_backward(step, self.sliced(batches), scale * self.cp_size, phase, wait, sync)

    def eval_losses(self, step: StepFunctions, batches: Sequence[Batch]) -> Losses:
        return super().eval_losses(step, self.sliced(batches))
