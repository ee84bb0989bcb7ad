"""Tensor parallelism in PyTorch (Megatron), with DTensor's `parallelize_module`: the split is
common/strategy.py's.

q/k/v and gate/up are `ColwiseParallel` (weights Shard(0): output features 1/N per rank), o_proj and
down_proj `RowwiseParallel` (Shard(1): input features; the partial outputs are all-reduced). The gradient
flowing back into the column-parallel layers is summed over ranks once per attention and once per MLP:
`PrepareModuleInput` hands the attention and the MLP a replicated DTensor, so q, k and v add their partial
input gradients as DTensors and one all-reduce happens where it turns back into a plain tensor (Megatron's
"f"; ColwiseParallel alone would all-reduce in each of q, k and v). Embedding, norms and lm_head stay plain
replicated tensors (why: common/strategy.py); their inputs and incoming gradients are the same on every
rank, so are their gradients, and nothing averages them.

Bytes all-reduced are counted in the collectives the first step issues (a dispatch mode sees every one;
the step's shapes are those of every step). Mirrors mlx_impl/tp.py.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               parallelize_module)
from torch.utils._python_dispatch import TorchDispatchMode

ALL_REDUCES = ("_c10d_functional::all_reduce", "c10d::allreduce_")


class CommCounter(TorchDispatchMode):
    """Bytes given to all-reduce by the ops run under it."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.name() in ALL_REDUCES:
            tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        return func(*args, **(kwargs or {}))


class TensorParallel:
    """One model's split over every rank, and what the Trainer needs to train and checkpoint it."""

    def __init__(self, device: torch.device):
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.mesh = init_device_mesh(device.type, (self.size,))

    def parallelize(self, model) -> None:
        """Shard a loaded full model in place (the sharded weights become DTensors, under the same names)."""
        for block in model.model.layers:
            parallelize_module(block, self.mesh, {
                "self_attn": PrepareModuleInput(input_layouts=(Replicate(), None),
                                                desired_input_layouts=(Replicate(), None)),
                "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                "mlp": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(),
            })
            attn = block.self_attn
            attn.n_heads, attn.n_kv_heads = attn.n_heads // self.size, attn.n_kv_heads // self.size
        self.params = dict(model.named_parameters())

    @torch.no_grad()
    def clip_grad_norm_(self, params, max_norm: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """clip_grad_norm_ over the whole model: the squares of sharded gradients summed over ranks, those of
        replicated ones (the same on every rank) counted once. Clips in place; returns the norm."""
        grads = [(p.grad, isinstance(p.grad, DTensor)) for p in params if p.grad is not None]
        local = [g.to_local() if sharded else g for g, sharded in grads]

        def squares(tensors):
            norms = [torch.linalg.vector_norm(t, 2.0, dtype=dtype) for t in tensors]
            return torch.stack(norms).square().sum() if norms else torch.zeros((), dtype=dtype)

        sharded = squares([t for t, (_, is_sharded) in zip(local, grads) if is_sharded])
        dist.all_reduce(sharded)
        total = (squares([t for t, (_, is_sharded) in zip(local, grads) if not is_sharded]) + sharded).sqrt()
        if max_norm > 0:
            torch._foreach_mul_(local, torch.clamp(max_norm / (total + 1e-6), max=1.0))
        return total

    def gather(self, named: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
        """Full arrays from this rank's pieces (every rank calls it: collectives)."""
        return {name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().cpu().numpy().copy()
                for name, t in named.items()}

    def shard(self, named: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Full arrays as the parameters of the same names are held: DTensors of this rank's block for the
        sharded ones (every rank holds the whole array, so each keeps its block and nothing is sent)."""
        out = {}
        for name, full in named.items():
            like = self.params[name]
            full = torch.from_numpy(np.array(full)).to(like.device)
            out[name] = (distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
                         if isinstance(like, DTensor) else full)
        return out


def local_nbytes(t: torch.Tensor) -> int:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()
