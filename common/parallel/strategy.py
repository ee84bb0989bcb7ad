"""How a run splits the work over its ranks: the strategy axis, framework-neutral.

    ddp   replicated data parallelism: every rank holds the whole model, reads 1/N of the global batch,
          and the gradients are averaged (today's behaviour, the default).
    fsdp  sharded data parallelism (ZeRO-3 / FSDP2): like ddp for the data, but each rank keeps 1/N of the
          parameters, gradients and optimizer state, gathering parameters for compute.
    tp    tensor parallelism (Megatron): each layer's matrices are split over the ranks, and every rank
          reads the whole global batch, so a tp run at N ranks computes what one ddp rank computes.
    pp    pipeline parallelism: each rank holds a contiguous run of blocks (a stage, common/parallel/pipeline.py);
          activations flow down the stages, their gradients back up, micro-batch by micro-batch. Every
          rank reads the whole global batch (no data parallelism beside it), like tp.

The framework code for each lives in a file of the same name in mlx_impl/ and torch_impl/.
"""
from __future__ import annotations

from common.errors import UserError
from common.model.precision import policy
from common.model.spec import ModelSpec
from common.model.weights import parameter_shapes

STRATEGIES = ("ddp", "fsdp", "tp", "pp")
# One replica between all the ranks: every rank reads the whole global batch, nothing is averaged.
MODEL_PARALLEL = ("tp", "pp")

# What sets axis 0 of each transformer-block parameter, for the message that says what to change.
_AXIS0_FIELD = {"input_layernorm": "model.dim", "post_attention_layernorm": "model.dim", "q_proj": "model.dim",
                "o_proj": "model.dim", "down_proj": "model.dim", "gate_proj": "model.ffn_dim",
                "up_proj": "model.ffn_dim", "k_proj": "model.n_kv_heads x head_dim",
                "v_proj": "model.n_kv_heads x head_dim"}


def data_parallel(strategy: str, rank: int, world_size: int) -> tuple[int, int]:
    """(data-parallel rank, data-parallel size): which slice of the global batch a rank reads.

    TP and PP ranks are one model replica between them, so all of them read the whole batch."""
    if strategy in MODEL_PARALLEL:
        return 0, 1
    return rank, world_size


def check_strategy(strategy: str, spec: ModelSpec, world_size: int) -> None:
    """Refuse, before anything is written, a run whose strategy cannot split this model over these ranks."""
    if strategy != "ddp" and (spec.attention_bias or spec.mlp_bias):
        # tp's sharding plans and pp's stages are written for bias-free Linears; fsdp's parity with biases is
        # untested: refused rather than trusted.
        field = "attention_bias" if spec.attention_bias else "mlp_bias"
        raise UserError(f"--strategy {strategy} does not support biases (model.{field} = true, from the "
                        "checkpoint's config); use --strategy ddp")
    if strategy == "fsdp":
        check_fsdp(spec, world_size)
    elif strategy == "tp":
        check_tp(spec, world_size)
    elif strategy == "pp":
        check_pp(spec, world_size)


def check_pp(spec: ModelSpec, world_size: int) -> None:
    """One stage per rank, each with at least one transformer block; untied embeddings (a tied matrix would
    live on the first and the last stage, and its gradient would have to be summed between them)."""
    if world_size < 2:
        raise UserError("--strategy pp puts one pipeline stage on each rank and needs at least 2 (--nproc 2); "
                        "use --strategy ddp for one rank")
    if spec.n_layers < world_size:
        raise UserError(f"--strategy pp over {world_size} stages needs at least one transformer block per stage, "
                        f"but model.n_layers = {spec.n_layers} < {world_size}: use --nproc {spec.n_layers} or fewer, "
                        f"or --set model.n_layers={world_size}")
    if spec.tie_embeddings:
        raise UserError("--strategy pp does not support tied embeddings (model.tie_embeddings = true): the "
                        "embedding lives on the first stage and the head on the last, and their shared gradient "
                        "is not summed between them; use --strategy ddp, fsdp or tp, or untie the embeddings")


def check_pp_microbatches(global_batch: int, grad_accum: int, microbatches: int) -> None:
    """Each micro-step's batch (global batch / grad accum) is cut into --pp-microbatches equal pieces."""
    per_step = global_batch // grad_accum
    if microbatches <= 0 or per_step % microbatches:
        raise UserError(f"--pp-microbatches {microbatches} must divide the batch of each micro-step: global batch "
                        f"size {global_batch} / grad accum {grad_accum} = {per_step} sequences; use a divisor "
                        f"of {per_step}")


def check_fsdp(spec: ModelSpec, world_size: int) -> None:
    """FSDP shards every transformer-block parameter along axis 0, so that axis must divide by N.

    MLX's nn.fully_shard cannot split an uneven axis; torch's FSDP2 could (it pads), but both frameworks
    run the same sharding. The embedding and the head need not divide: both frameworks pad the vocabulary
    to a multiple of N with zero rows (FSDP2 inside, mlx_impl/fsdp.py by hand), `fsdp_rows` below.
    """
    if world_size < 2:
        raise UserError("strategy fsdp shards the model over the ranks and needs 2 or more: pass --nproc 2 "
                        "(or more), or --strategy ddp")
    for name, shape in parameter_shapes(spec).items():
        if name.startswith("model.layers.") and shape[0] % world_size:
            field = _AXIS0_FIELD[name.split(".")[-2]]
            raise UserError(f"strategy fsdp cannot shard {name} of shape {shape} over {world_size} ranks: "
                            f"axis 0 ({shape[0]}, set by {field}) must divide by {world_size}; change "
                            f"{field} or --nproc, or use --strategy ddp")


def fsdp_rows(length: int, rank: int, world_size: int) -> slice:
    """The rows of axis 0 (of `length`) a rank keeps under fsdp: torch.chunk's split, which FSDP2 uses.
    Every rank holds ceil(length / N) rows; the last ranks' blocks run short (or empty) where N does not
    divide, and the framework pads them with zero rows to the common size."""
    rows = -(-length // world_size)
    return slice(min(rank * rows, length), min((rank + 1) * rows, length))


# ---- tensor parallelism: the split, shared by both frameworks and the checkpoint code -----------------
# Megatron's pairing: a column-parallel layer (output features split) feeds a row-parallel one (input
# features split), so the activations between them stay on their rank and each pair needs one
# all-reduce forward (after the row-parallel layer) and one backward (into the column-parallel layers'
# common input). q/k/v split by head, so each rank runs n_heads/N query heads and n_kv_heads/N kv heads;
# with contiguous head blocks, rank r's query heads are exactly those its kv heads serve (GQA).
#
# The embedding, the norms and lm_head stay replicated: they are small next to the layers (except the
# vocabulary matrices), their inputs are replicated anyway, and replicas get identical gradients with no
# communication. Sharding the vocabulary would split embed_tokens by rows (a masked lookup plus an
# all-reduce) and lm_head by output rows, with a vocab-parallel cross-entropy (all-reduces of the max and of
# the sum of exp over the shards) so that full logits never exist on one rank: worth it when the vocabulary
# dominates memory (base: 2 x 50000 x 768 of its 86M parameters).
TP_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # weight (out, in): rows split
TP_ROW = ("o_proj", "down_proj")                                     # weight (out, in): columns split


def tp_split_axis(name: str) -> int | None:
    """The axis of an HF-named weight that tensor parallelism splits; None for a replicated one."""
    parts = name.split(".")
    layer = parts[-2] if len(parts) >= 2 else ""
    if layer in TP_COLUMN:
        return 0
    if layer in TP_ROW:
        return 1
    return None


def tp_shard(name: str, full, rank: int, world_size: int):
    """This rank's contiguous block of a full array (numpy or anything with the same slicing)."""
    index = tp_index(name, full.shape, rank, world_size)
    return full[index] if index else full


def tp_index(name: str, shape: tuple, rank: int, world_size: int) -> tuple:
    """The index (common/checkpoint/tensorsource.py's Index) of this rank's block of a whole tensor; () reads it all."""
    axis = tp_split_axis(name)
    if axis is None:
        return ()
    size = shape[axis] // world_size
    return (slice(None),) * axis + (slice(rank * size, (rank + 1) * size),)


def check_tp(spec: ModelSpec, world_size: int) -> None:
    """TP splits heads, KV heads and the FFN width over the ranks: each must divide by N."""
    if world_size < 2:
        raise UserError("--strategy tp splits each layer over the ranks and needs at least 2 (--nproc 2); "
                        "use --strategy ddp for one rank")
    for field in ("n_heads", "n_kv_heads", "ffn_dim"):
        value = getattr(spec, field)
        if value % world_size:
            raise UserError(f"--strategy tp over {world_size} ranks splits model.{field} = {value}, which is "
                            f"not divisible by {world_size}: run on a number of ranks that divides {value}, or "
                            f"--set model.{field}=N with N a multiple of {world_size}")


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def comm_bytes_per_step_estimate(strategy: str, spec, world_size: int, micro_batch_size: int, seq_len: int,
                                 grad_accum: int, dtype: str = "float32") -> int | None:
    """Bytes handed to all-reduce per optimizer step (payload, not wire traffic: a ring all-reduce sends
    2 (N-1)/N times it per rank), from the shapes alone. Scalars (loss, grad-norm partial sums) are left out.
    `dtype` is the run's --dtype: the policy's reduce dtype for gradients, its compute dtype for
    activations (common/model/precision.py; bf16 activations are half the bytes).

        ddp  every gradient once:                  parameters x reduce bytes (4: float32 in every policy)
        tp   per layer and micro-step, 2 all-reduces forward (after o_proj and down_proj) and 2 backward
             (into q/k/v's and gate/up's common input), each of the activations (B, T, dim):
                                                   4 x layers x B x T x dim x compute bytes x grad_accum
        pp   not an all-reduce: the bytes rank 0 (the first stage) sends, the activations of the whole
             global batch to the next stage (common/parallel/pipeline.py), in the compute dtype:
                                                   B x grad_accum x T x dim x compute bytes
    """
    if world_size < 2:
        return 0
    p = policy(dtype)
    if strategy == "ddp":
        from common.model.weights import num_parameters

        return num_parameters(spec) * DTYPE_BYTES[p.reduce_dtype]
    if strategy == "tp":
        return 4 * spec.n_layers * micro_batch_size * seq_len * spec.dim * DTYPE_BYTES[p.compute_dtype] * grad_accum
    if strategy == "pp":
        from common.parallel.pipeline import comm_bytes_per_step as pp_bytes

        return pp_bytes(micro_batch_size * grad_accum, seq_len, spec.dim, DTYPE_BYTES[p.compute_dtype])
    return None  # fsdp gathers and reduce-scatters rather than all-reduces: its own formula
