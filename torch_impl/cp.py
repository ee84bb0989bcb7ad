"""Context parallelism in PyTorch (`--strategy cp`, `--mesh dp=2,cp=2`): each rank keeps its slice of the sequence
outside attention, and Ulysses's all-to-alls give attention the whole sequence for heads / cp of the heads. The split
and its cost: common/parallel/cp.py. Mirrors mlx_impl/cp.py.

The exchanges are gloo's all_to_all_single (it runs on CPU, FACTS.md) in an autograd Function whose backward is the
reverse exchange. torch.distributed.tensor.experimental.context_parallel is not used: it swaps
scaled_dot_product_attention for a ring over DTensor shards (its own load balancer and buffers), which would leave
MLX's twin nothing to mirror; whether it runs on gloo was not tried.

The strategy is ddp's (`Replicated`, DDP over every rank of the job): each rank's gradients are those of its own
tokens, scaled by cp so that DDP's average over dp x cp ranks is the gradient of the step's loss; the loss sums over
the world. The cp exchanges run on a group of their own, apart from DDP's (its bucket all-reduces run from hooks
while the backward's exchanges are issued).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from common.checkpoint.tensorsource import TensorSource
from common.config import RunConfig
from common.parallel.cp import positions_for, ring_blocks
from common.train.heap import release_freed_heap
from common.train.protocols import Batch, ForwardBackwardResult, Phase, World, no_phase

from .comm import CommCounter
from .ddp import Replicated
from .fsdp import release_heap_in_backward
from .microsteps import Grads, StepFunctions
from .model import Attention, Llama, _rope_tensors, attention


def _seq_to_heads(x: torch.Tensor, group: Any, n: int) -> torch.Tensor:
    """(B, H, T/n, D) -> (B, H/n, T, D): head group j of this rank's slice to rank j."""
    B, H, Tl, D = x.shape
    send = x.reshape(B, n, H // n, Tl, D).permute(1, 0, 2, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[i]: rank i's slice of this rank's heads
    return recv.permute(1, 2, 0, 3, 4).reshape(B, H // n, n * Tl, D)


def _heads_to_seq(y: torch.Tensor, group: Any, n: int) -> torch.Tensor:
    """(B, H/n, T, D) -> (B, H, T/n, D): slice j of this rank's heads to rank j."""
    B, Hc, T, D = y.shape
    send = y.reshape(B, Hc, n, T // n, D).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[i]: head group i of this rank's slice
    return recv.permute(1, 0, 2, 3, 4).reshape(B, n * Hc, T // n, D)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, n):
        ctx.group, ctx.n = group, n
        return _seq_to_heads(x, group, n)

    @staticmethod
    def backward(ctx, dy):
        return _heads_to_seq(dy.contiguous(), ctx.group, ctx.n), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group, n):
        ctx.group, ctx.n = group, n
        return _heads_to_seq(y, group, n)

    @staticmethod
    def backward(ctx, dx):
        return _seq_to_heads(dx.contiguous(), ctx.group, ctx.n), None, None


Exchange = Callable[[torch.Tensor], torch.Tensor]


def ulysses_exchanges(group: Any, rank: int, size: int, comm: CommCounter | None = None) -> tuple[Exchange, Exchange]:
    """(seq_to_heads, heads_to_seq) over `group`: (B, H, T/n, D) -> (B, H/n, T, D) and back, each the other's
    gradient. (`rank` and `comm`: MLX's twin slices by rank and counts as it traces; torch's first step is counted
    by the strategy's watch.)"""
    def seq_to_heads(x: torch.Tensor) -> torch.Tensor:
        return _SeqToHeads.apply(x.contiguous(), group, size)

    def heads_to_seq(y: torch.Tensor) -> torch.Tensor:
        return _HeadsToSeq.apply(y.contiguous(), group, size)

    return seq_to_heads, heads_to_seq


def _passed(x: torch.Tensor, group: Any, to: int, source: int) -> torch.Tensor:
    """x sent to global rank `to`, the same shape received from global rank `source` (gloo's isend/irecv)."""
    received = torch.empty_like(x)
    for request in (dist.isend(x, to, group=group), dist.irecv(received, source, group=group)):
        request.wait()
    return received


class _FromPrevious(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, previous, following):
        ctx.group, ctx.previous, ctx.following = group, previous, following
        return _passed(x, group, following, previous)

    @staticmethod
    def backward(ctx, dy):
        return _passed(dy.contiguous(), ctx.group, ctx.previous, ctx.following), None, None, None


def ring_passes(group: Any, rank: int, size: int, comm: CommCounter | None = None) -> Exchange:
    """The ring's step: the block of the rank before this one in the cp group (send to the next, receive from the
    previous), its gradient sent back the other way in the backward. (`comm`: MLX's twin counts as it traces.)"""
    previous, following = (dist.get_global_rank(group, (rank + d) % size) for d in (-1, 1))

    def from_previous(x: torch.Tensor) -> torch.Tensor:
        return _FromPrevious.apply(x.contiguous(), group, previous, following)

    return from_previous


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(q k^T scale + bias) v, its rows' logsumexp) in float32, (B, H, t, D) queries against (B, KV, s, D)
    keys and values (grouped-query: each kv head repeated for its query heads)."""
    q, k, v = q.float(), k.float(), v.float()
    if k.shape[1] != q.shape[1]:
        k, v = k.repeat_interleave(q.shape[1] // k.shape[1], 1), v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    scores = (q * scale) @ k.transpose(-1, -2)
    if bias is not None:
        scores = scores + bias
    peak = scores.amax(dim=-1, keepdim=True).detach()
    e = torch.exp(scores - peak)
    rows = e.sum(dim=-1, keepdim=True)
    return (e @ v) / rows, peak + torch.log(rows)


def merged(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
           block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The online softmax's step: two partial attentions of the same queries over disjoint keys, as one."""
    both = torch.logaddexp(lse, block_lse)
    return out * torch.exp(lse - both) + block_out * torch.exp(block_lse - both), both


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, rank: int, size: int,
                   from_previous: Exchange) -> torch.Tensor:
    """Causal attention of the rank's zig-zag chunks (q, k, v: (B, heads, 2c, D), positions common/parallel/cp.py
    zigzag_positions) over the whole sequence: its own block under the causal mask, then cp - 1 times the key/value
    block of the rank before passed on, each merged into the chunks' running (output, logsumexp), the half of each
    block that lies wholly in the future skipped (ring_blocks)."""
    c = q.shape[2] // 2
    positions = torch.from_numpy(positions_for("ring", 2 * c * size, rank, size)).to(q.device)
    bias = torch.zeros(2 * c, 2 * c, device=q.device).masked_fill(positions[:, None] < positions[None], -torch.inf)
    out, lse = block_attention(q, k, v, scale, bias)
    first, second = (out[:, :, :c], lse[:, :, :c]), (out[:, :, c:], lse[:, :, c:])
    kv = torch.stack([k, v])
    for step in range(1, size):
        kv = from_previous(kv)
        if ring_blocks(rank, (rank - step) % size) == "first":
            block_out, block_lse = block_attention(q, kv[0][:, :, :c], kv[1][:, :, :c], scale)
            first = merged(*first, block_out[:, :, :c], block_lse[:, :, :c])
            second = merged(*second, block_out[:, :, c:], block_lse[:, :, c:])
        else:
            second = merged(*second, *block_attention(q[:, :, c:], kv[0], kv[1], scale))
    return torch.cat([first[0], second[0]], dim=2).to(q.dtype)


class UlyssesAttention(Attention):
    """The block's attention on the rank's slice: q, k, v of its tokens rotated at their global positions, the
    all-to-alls around the whole-length core, o_proj on its tokens. The projections are the block's own modules."""

    release_heap = False  # sequence_attention's: give glibc's freed heap back as the block's attention ends

    @classmethod
    def from_attention(cls, attn: Attention, rank: int, size: int, exchanges: Any) -> "UlyssesAttention":
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.n_heads, layer.n_kv_heads, layer.scale = attn.n_heads, attn.n_kv_heads, attn.scale
        layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        layer.rope = attn.rope
        layer.cp_rank, layer.cp_size, layer.exchanges = rank, size, exchanges
        return layer

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        n, (seq_to_heads, heads_to_seq) = self.cp_size, self.exchanges
        B, Tl, _ = x.shape
        q = self.q_proj(x).view(B, Tl, self.n_heads, -1).transpose(1, 2)
        k = self.k_proj(x).view(B, Tl, self.n_kv_heads, -1).transpose(1, 2)
        v = self.v_proj(x).view(B, Tl, self.n_kv_heads, -1).transpose(1, 2)
        positions = torch.from_numpy(positions_for("ulysses", Tl * n, self.cp_rank, n)).to(x.device)
        q, k = rope_at(self.rope, q, positions, Tl * n), rope_at(self.rope, k, positions, Tl * n)
        out = attention(seq_to_heads(q), seq_to_heads(k), seq_to_heads(v), self.scale, None)  # causal, whole T
        out = self.o_proj(heads_to_seq(out).transpose(1, 2).reshape(B, Tl, -1))
        released(self)
        return out


class RingAttention(UlyssesAttention):
    """The block's attention on the rank's zig-zag chunks: q, k, v rotated at their global positions, ring_attention
    over the cp group (`from_previous` in place of Ulysses's exchanges), o_proj on its tokens."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        n, rank = self.cp_size, self.cp_rank
        B, Tl, _ = x.shape
        q = self.q_proj(x).view(B, Tl, self.n_heads, -1).transpose(1, 2)
        k = self.k_proj(x).view(B, Tl, self.n_kv_heads, -1).transpose(1, 2)
        v = self.v_proj(x).view(B, Tl, self.n_kv_heads, -1).transpose(1, 2)
        positions = torch.from_numpy(positions_for("ring", Tl * n, rank, n)).to(x.device)
        q, k = rope_at(self.rope, q, positions, Tl * n), rope_at(self.rope, k, positions, Tl * n)
        out = ring_attention(q, k, v, self.scale, rank, n, self.exchanges)
        out = self.o_proj(out.transpose(1, 2).reshape(B, Tl, -1))
        released(self)
        return out


def released(layer: UlyssesAttention) -> None:
    """glibc's freed heap given back to the OS (malloc_trim) as a block's attention ends, in a training forward,
    where the layer asks (sequence_attention; SequenceParallel adds fsdp's two in the backward). The transients of
    each attention (RoPE's, the exchanges' send, receive and reordered copies) leave freed blocks inside the heap
    that glibc keeps resident (common/train/heap.py), and a cp rank's RSS peaked on them, not on what autograd keeps.
    `small`, 2 x 1024 tokens, cp=2 Ulysses, Zen 3: a rank's tensors saved for the backward 106 MB against ddp x1's
    187 (0.57); its activations by peak RSS (benchmarks/cp_memory.py) 0.71-0.76 of ddp x1's without the releases,
    0.53-0.56 with; without the backward's two 0.59-0.62. They cost about a sixth of a step there (644-656 ms
    against 517-534 ms, 8 steps, load 2.1-2.9). MLX needs no counterpart (mlx_impl/cp.py sequence_attention)."""
    if layer.release_heap and torch.is_grad_enabled():
        release_freed_heap()


def rope_at(rope: nn.Module, x: torch.Tensor, positions: torch.Tensor, seq_len: int) -> torch.Tensor:
    """model.py's RoPE of (B, H, t, D) tokens at global `positions` of a sequence of `seq_len`."""
    cos, sin = _rope_tensors(rope.spec, seq_len, x.device)
    cos, sin = cos[positions].to(x.dtype), sin[positions].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def exchanges_for(attention: str, group: Any, rank: int, size: int, comm: CommCounter | None = None) -> Any:
    """--cp-attention's exchanges over the cp group: ring's pass from the previous rank, or Ulysses's pair."""
    return (ring_passes(group, rank, size, comm) if attention == "ring" else
            ulysses_exchanges(group, rank, size, comm))


def sequence_attention(model: Any, attention: str, rank: int, size: int, exchanges: Any,
                       release_heap: bool = False) -> None:
    """Every block's attention, in place, as the cp rank's (before a model axis splits or keeps the blocks: the
    projections stay the block's own modules, so tp's plan and pp's stages see the same names). release_heap: each
    gives glibc's freed heap back as it ends in a training forward (`released`)."""
    kind = RingAttention if attention == "ring" else UlyssesAttention
    for block in model.model.layers:
        block.self_attn = kind.from_attention(block.self_attn, rank, size, exchanges)
        block.self_attn.release_heap = release_heap


def sequence_slices(batches: Sequence[Batch], attention: str, rank: int, size: int) -> list[Batch]:
    """The cp rank's positions of each micro-batch's (inputs, targets, mask)."""
    out = []
    for inputs, targets, mask in batches:
        mine = positions_for(attention, inputs.shape[1], rank, size)
        out.append((inputs[:, mine], targets[:, mine], mask[:, mine]))
    return out


class SequenceParallel(Replicated):
    """The cp strategy (common/train/protocols.py), alone or beside dp: DDP over every rank of the job, each rank
    on its slice of the rows its data rank reads."""

    loss_over = "world"  # every rank holds the token losses of its own slice

    def __init__(self, cfg: RunConfig, world: World, comm: CommCounter):
        super().__init__(cfg, world, comm)
        self.dp_size = world.size  # DDP over dp x cp
        self.keeps_grads = self.dp_size > 1
        cp = world.axes.get("cp")
        self.cp_rank, self.cp_size = (cp.rank, cp.size) if cp else (world.rank, world.size)
        group = cp.group if cp else dist.new_group(list(range(world.size)))  # apart from DDP's
        self.attention = cfg.cp_attention
        self.exchanges = exchanges_for(self.attention, group, self.cp_rank, self.cp_size, comm)
        # The host heap holds a CPU rank's activations; --tune-malloc keeps freed memory on purpose (heap.py).
        self.release_heap = self.device.type == "cpu" and not cfg.tune_malloc

    def wrap(self, model: Llama, source: TensorSource) -> nn.Module:
        sequence_attention(model, self.attention, self.cp_rank, self.cp_size, self.exchanges, self.release_heap)
        if self.release_heap:
            release_heap_in_backward(model)
        return super().wrap(model, source)

    def sliced(self, batches: Sequence[Batch]) -> list[Batch]:
        """This rank's positions of each micro-batch's (inputs, targets, mask)."""
        return sequence_slices(batches, self.attention, self.cp_rank, self.cp_size)

    def forward_backward(self, step: StepFunctions, batches: Sequence[Batch], scale: float,
                         phase: Phase = no_phase, wait: bool = False,
                         sync: bool = True) -> ForwardBackwardResult[torch.Tensor, Grads]:
        """Scaled by cp: DDP's average over dp x cp ranks is then the step's gradient (the module docstring)."""
        return super().forward_backward(step, self.sliced(batches), scale * self.cp_size, phase, wait, sync)

    def eval_losses(self, step: StepFunctions, batches: Sequence[Batch]) -> torch.Tensor:
        return super().eval_losses(step, self.sliced(batches))
