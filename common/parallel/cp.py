"""cp: context parallelism, the sequence axis. Every rank of a cp group reads the same rows (as tp's do) and keeps
only its slice of each sequence, in every layer, outside attention: the embedding, the norms, the MLP, lm_head and
the loss see T / cp tokens. Attention needs every earlier key, so the slices meet there (Ulysses, DeepSpeed's
"sequence parallelism"): an all-to-all turns (T/cp tokens, all heads) into (all tokens, heads/cp) before the core and
back after it, so each rank runs the whole causal attention of its heads. The framework code: mlx_impl/cp.py,
torch_impl/cp.py.

Why `cp` and not `sp`: Megatron-LM's "sequence parallelism" is another thing, the tp group splitting the norms'
and dropouts' activations along the sequence; Megatron's `--context-parallel-size`, torch's
`torch.distributed.tensor.experimental.context_parallel` and torchtitan's mesh axis call this one `cp`.

The weights are whole on every rank, and every rank's gradients are partial (those of its own tokens): a cp rank is
a ddp rank whose batch is a slice of the sequence. So the gradients are averaged over every rank of the job (dp x cp)
after the backward, each rank having scaled its gradient by cp (Trainer's scale x cp), and the loss is the sum of
every rank's token losses over the global count of targets (common/train/normalization.py): exact.

Positions are the global ones: rank r's slice is positions [r T/cp, (r+1) T/cp) (`cp_positions`); RoPE rotates each
token by its own position (the tables of the whole length, indexed).

Its cost (common/costmodel/, docs/scaling.md):

    f_work     1/cp of the tokens: every matmul, and attention (each rank the whole length for its heads)
    f_state    1: the whole model on every rank
    traffic    per layer and micro-step 4 all-to-alls forward (q, k, v, the output) and 4 backward, each of the
               rank's (B, T/cp, heads x head_dim) in the compute dtype; torch's all_to_all_single sends (cp-1)/cp of
               it. MLX has no all-to-all: it all-gathers the whole tensor and keeps its slice, cp times the
               all-to-all's bytes on the wire and cp times the tensor in memory for a moment. Plus ddp's
               all-reduce of the fp32 gradients over the job.
    memory     the activations of T/cp tokens (the scores of heads/cp over the whole length: the same per token)
    exposed    the all-to-alls sit on the critical path (the next op needs them); the gradient all-reduce as ddp's
"""
from __future__ import annotations

from typing import ClassVar

import numpy as np

from common.costmodel.links import Collective, Link
from common.costmodel.workload import Workload
from common.errors import UserError
from common.model.precision import policy
from common.model.spec import ModelSpec
from common.parallel.ddp import DdpLayout, gradient_all_reduce
from common.parallel.layout import DTYPE_BYTES, Layout, Measured, total_parameters

def cp_positions(seq_len: int, rank: int, size: int) -> np.ndarray:
    """The global positions rank `rank` of a cp group of `size` holds: its contiguous T / size."""
    chunk = seq_len // size
    return np.arange(rank * chunk, (rank + 1) * chunk)


def zigzag_positions(seq_len: int, rank: int, size: int) -> np.ndarray:
    """Ring attention's balanced split (Megatron's, not used yet): the sequence in 2 x size chunks, rank r holding
    chunks r and 2 size - 1 - r, so that each rank's causal work (queries x earlier keys) is the same."""
    chunk = seq_len // (2 * size)
    first, second = rank, 2 * size - 1 - rank
    return np.concatenate([np.arange(first * chunk, (first + 1) * chunk), np.arange(second * chunk, (second + 1) * chunk)])


# --cp-attention: which positions a rank holds under each attention (the frameworks' cp.py pick their core by it)
CP_ATTENTIONS = {"ulysses": cp_positions, "ring": zigzag_positions}


def positions_for(attention: str, seq_len: int, rank: int, size: int) -> np.ndarray:
    return CP_ATTENTIONS[attention](seq_len, rank, size)


def ring_blocks(rank: int, source: int) -> str:
    """Which part of ring attention's work a rank does with the key/value block of rank `source` (zig-zag): its
    own ("causal": both chunks, under the causal mask), an earlier rank's ("first": every query against the block's
    first chunk, whole; its second chunk lies after both of the rank's), or a later rank's ("second": the rank's
    second chunk against the whole block; its first chunk precedes every key of it). Each skipped half lies wholly
    in the future, so every step after the first costs half a block: the same on every rank."""
    return "causal" if source == rank else "first" if source < rank else "second"


def causal_work(positions: np.ndarray) -> int:
    """Query-key pairs a rank's causal attention computes: sum over its queries of (position + 1)."""
    return int((positions + 1).sum())


class CpLayout(Layout):
    name: ClassVar[str] = "cp"
    reads_whole_batch: ClassVar[bool] = True  # the cp ranks of one data rank read the same rows

    def check(self, spec: ModelSpec, cp_attention: str = "ulysses") -> None:
        """Ulysses gives each rank heads / cp query heads and kv_heads / cp kv heads: both must divide. The ring keeps
        every head on every rank (each holds a slice of the tokens), so it asks nothing of the heads."""
        super().check(spec)
        n = self.ranks
        if n < 2:
            raise UserError("--strategy cp splits each sequence over the ranks and needs at least 2 (--nproc 2); "
                            "use --strategy ddp for one rank")
        for field in ("n_heads", "n_kv_heads") if cp_attention == "ulysses" else ():
            value = getattr(spec, field)
            if value % n:
                raise UserError(f"cp={n}: Ulysses splits model.{field} = {value} over the cp ranks, which {n} does "
                                f"not divide; use a cp size that divides {value}, or --cp-attention ring")

    def check_sequence(self, seq_len: int, padding_rule: str, cp_attention: str = "ulysses") -> None:
        """Each rank's slice is seq_len / cp tokens (ring: two chunks of seq_len / 2 cp), of one width every step."""
        n = self.ranks
        if cp_attention == "ring" and seq_len % (2 * n):
            raise UserError(f"--cp-attention ring cuts each sequence into 2 x cp = {2 * n} chunks (zig-zag), but "
                            f"--seq-len {seq_len} is not divisible by {2 * n}; use a multiple of {2 * n}")
        if seq_len % n:
            raise UserError(f"cp={n} cuts each sequence into {n} slices, but --seq-len {seq_len} is not divisible "
                            f"by {n}; use a multiple of {n}")
        if padding_rule != "seq-len":
            raise UserError(f"--padding-rule {padding_rule} changes the batch's width from step to step, and cp "
                            "cuts it into equal slices; use --padding-rule seq-len with cp")

    def local_parameters(self, spec: ModelSpec, framework: str = "torch") -> float:
        return total_parameters(spec)

    def work_fraction(self, w: Workload) -> float:
        return 1.0 / self.ranks

    def all_to_all_bytes(self, w: Workload) -> tuple[float, float]:
        """(q and the output, k and v): one all-to-all's input per rank, (B, T/cp, heads x head_dim) in the
        compute dtype."""
        s, rows = w.spec, w.micro_rows(self.dp_size)
        per_head = rows * (w.seq_len / self.ranks) * s.head_dim * DTYPE_BYTES[policy(w.dtype).compute_dtype]
        return per_head * s.n_heads, per_head * s.n_kv_heads

    def step_collectives(self, w: Workload, reduce_scatter: str) -> list[Collective]:
        """Per layer and micro-step, forward and backward, 2 all-to-alls of q-sized tensors and 2 of k-sized ones,
        as all-gathers: torch's all_to_all_single puts (cp-1)/cp of its input on the wire, an all-gather of that
        input; MLX all-gathers the input whole (cp times it)."""
        q, kv = self.all_to_all_bytes(w)
        times = self.ranks if w.framework == "mlx" else 1
        calls = 2 * 2 * w.spec.n_layers * w.grad_accum
        grads = DdpLayout(self.mesh).gradient_bytes(w.spec, w.dtype)
        return [Collective("all_gather", int(q * times), calls, "all-to-all q/out"),
                Collective("all_gather", int(kv * times), calls, "all-to-all k/v"),
                gradient_all_reduce(grads, w)]

    def payload_bytes_per_step(self, spec: ModelSpec, micro_batch_size: int, seq_len: int, grad_accum: int,
                               dtype: str) -> int | None:
        return None  # the attention's all-to-alls are not counted by the frameworks' counters yet

    @property
    def sequence_split(self) -> int:
        """The activations of T / cp tokens (layout.py's count): per token the same, the scores of heads / cp
        over the whole T."""
        return self.ranks

    def streamed_checkpoint_bytes(self, w: Workload, rank: int) -> float:
        return 0.0  # the whole state on every rank: views of it

    @property
    def copies_gradients_for_reduce(self) -> bool:
        return True

    def exposed_comm_s(self, cal: Measured, colls: list[Collective], link: Link | None, comm_s: float) -> float:
        return float(comm_s)  # the all-to-alls are on the critical path, and dominate at long sequences
