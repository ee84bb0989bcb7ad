"""How a run splits the work over its ranks: the strategy axis, framework-neutral.

    ddp   replicated data parallelism: every rank holds the whole model, reads 1/N of the global batch,
          and the gradients are averaged (today's behaviour, the default).
    fsdp  sharded data parallelism (ZeRO-3 / FSDP2): like ddp for the data, but each rank keeps 1/N of the
          parameters, gradients and optimizer state, gathering parameters for compute.
    tp    tensor parallelism (Megatron): each layer's matrices are split over the ranks, and every rank
          reads the whole global batch, so a tp run at N ranks computes what one ddp rank computes.

The framework code for each lives in a file of the same name in mlx_impl/ and torch_impl/.
"""
from __future__ import annotations

from .errors import UserError
from .spec import ModelSpec
from .weights import parameter_shapes

STRATEGIES = ("ddp", "fsdp", "tp")

# What sets axis 0 of each transformer-block parameter, for the message that says what to change.
_AXIS0_FIELD = {"input_layernorm": "model.dim", "post_attention_layernorm": "model.dim", "q_proj": "model.dim",
                "o_proj": "model.dim", "down_proj": "model.dim", "gate_proj": "model.ffn_dim",
                "up_proj": "model.ffn_dim", "k_proj": "model.n_kv_heads x head_dim",
                "v_proj": "model.n_kv_heads x head_dim"}


def data_parallel(strategy: str, rank: int, world_size: int) -> tuple[int, int]:
    """(data-parallel rank, data-parallel size): which slice of the global batch a rank reads.

    TP ranks are one model replica between them, so all of them read the whole batch."""
    if strategy == "tp":
        return 0, 1
    return rank, world_size


def check_strategy(strategy: str, spec: ModelSpec, world_size: int) -> None:
    """Refuse, before anything is written, a run whose strategy cannot split this model over these ranks."""
    if strategy == "fsdp":
        check_fsdp(spec, world_size)


def check_fsdp(spec: ModelSpec, world_size: int) -> None:
    """FSDP shards every transformer-block parameter along axis 0, so that axis must divide by N.

    MLX's nn.fully_shard cannot split an uneven axis; torch's FSDP2 could (it pads), but both frameworks
    run the same sharding. The embedding and the head need not divide: MLX keeps them replicated then.
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
