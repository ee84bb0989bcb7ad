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

from typing import Callable, Sequence, cast

import mlx.core as mx
import mlx.nn as nn

from common.checkpoint.tensorsource import TensorSource
from common.config import RunConfig
from common.parallel.cp import cp_positions
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


class UlyssesAttention(Attention):
    """The block's attention on the rank's slice: q, k, v of its tokens rotated at their global positions, the
    all-to-alls around the whole-length core, o_proj on its tokens. The projections are the block's own modules."""

    @classmethod
    def from_attention(cls, attn: Attention, rank: int, size: int, exchanges: tuple[Exchange, Exchange]):
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
        positions = mx.array(cp_positions(Tl * size, rank, size))
        q, k = rope_at(self.rope, q, positions, Tl * size), rope_at(self.rope, k, positions, Tl * size)
        out = attention(seq_to_heads(q), seq_to_heads(k), seq_to_heads(v), self.scale, "causal")
        return self.o_proj(heads_to_seq(out).transpose(0, 2, 1, 3).reshape(B, Tl, -1))


def rope_at(rope: nn.Module, x: mx.array, positions: mx.array, seq_len: int) -> mx.array:
    """model.py's RoPE of (B, H, t, D) tokens at global `positions` of a sequence of `seq_len`."""
    cos, sin = _rope_arrays(rope.spec, seq_len)
    cos, sin = cos[positions].astype(x.dtype), sin[positions].astype(x.dtype)
    x1, x2 = mx.split(x, 2, axis=-1)
    return x * cos + mx.concatenate([-x2, x1], axis=-1) * sin


class SequenceParallel(Replicated):
    """The cp strategy (common/train/protocols.py), alone or beside dp: ddp over every rank of the job, each rank
    on its slice of the rows its data rank reads."""

    loss_over = "world"  # every rank holds the token losses of its own slice

    def __init__(self, cfg: RunConfig, world: World, comm: CommCounter):
        super().__init__(cfg, world, comm)
        self.dp_size = world.size  # the gradients averaged over dp x cp (communicates)
        cp = world.axes.get("cp", world)
        self.cp_rank, self.cp_size = cp.rank, cp.size
        self.exchanges = ulysses_exchanges(cp.group, cp.rank, cp.size, comm)

    def wrap(self, model: nn.Module, source: TensorSource) -> nn.Module:
        for block in model.model.layers:
            block.self_attn = UlyssesAttention.from_attention(block.self_attn, self.cp_rank, self.cp_size,
                                                              self.exchanges)
        return super().wrap(model, source)

    def sliced(self, batches: Sequence[Batch]) -> list[Batch]:
        """This rank's positions of each micro-batch's (inputs, targets, mask)."""
        out = []
        for inputs, targets, mask in batches:
            mine = cp_positions(inputs.shape[1], self.cp_rank, self.cp_size)
            out.append((inputs[:, mine], targets[:, mine], mask[:, mine]))
        return out

    def forward_backward(self, step: StepFunctions, batches: Sequence[Batch], scale: float,
                         phase: Phase = no_phase, wait: bool = False,
                         sync: bool = True) -> ForwardBackwardResult[Losses, Grads]:
        """Scaled by cp: the average over dp x cp ranks is then the step's gradient (the module docstring)."""
        return super().forward_backward(step, self.sliced(batches), scale * self.cp_size, phase, wait, sync)

    def eval_losses(self, step: StepFunctions, batches: Sequence[Batch]) -> Losses:
        return super().eval_losses(step, self.sliced(batches))
