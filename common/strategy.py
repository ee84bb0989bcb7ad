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

STRATEGIES = ("ddp", "fsdp", "tp")


def data_parallel(strategy: str, rank: int, world_size: int) -> tuple[int, int]:
    """(data-parallel rank, data-parallel size): which slice of the global batch a rank reads.

    TP ranks are one model replica between them, so all of them read the whole batch."""
    if strategy == "tp":
        return 0, 1
    return rank, world_size
