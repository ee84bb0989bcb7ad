"""How a rank fills its part of the model (or of AdamW's moments) from a TensorSource, in MLX.

The Trainer builds `Llama(spec)` and never evaluates it: MLX is lazy, so the random arrays nn.Linear and
nn.Embedding create at construction are graphs, not memory. The strategy then cuts the model to this
rank's part (slicing those graphs, still lazily: fully_shard's split, tp's column and row blocks, pp's
stage), and `load_local` replaces every parameter with the slice of it the strategy keeps
(`strategy.local_index`), read from the source. Only those arrays are ever evaluated, so a rank's peak
holds its own part of the model, not the whole. Mirrors torch_impl/load.py.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from common.checkpoint.tensorsource import TensorSource

SHARD = ".module."  # fully_shard puts the wrapped module under `module`; HF names never hold it


def hf_name(path: str) -> str:
    """A parameter's path in the (wrapped) model -> its HF name: fsdp's wrappers add `.module.`."""
    return path.replace(SHARD, ".")


def read_local(source: TensorSource, shapes: dict[str, tuple], local_index):
    """(path, this rank's slice of the tensor under the path's HF name) one at a time, each of the local
    shape in `shapes` ({path: shape}): a block that runs short (fsdp's last rank, an uneven vocabulary) is
    padded with zero rows, as FSDP2 pads; zero rows get zero gradients and stay zero under AdamW."""
    for path, shape in shapes.items():
        name = hf_name(path)
        value = source.read(name, local_index(name, source.shape(name)))
        if value.shape != tuple(shape):
            if value.shape[1:] != tuple(shape[1:]) or value.shape[0] > shape[0]:
                raise AssertionError(f"{name}: read {value.shape}, this rank holds {tuple(shape)}")
            value = np.concatenate([value, np.zeros((shape[0] - value.shape[0], *shape[1:]), value.dtype)])
        yield path, value


def load_local(model, source: TensorSource, local_index) -> None:
    """Set every parameter of the rank's part of the model from `source`, then evaluate them: the only
    arrays of the model that are ever materialised."""
    shapes = {path: p.shape for path, p in tree_flatten(model.parameters())}
    # mx.array copies each numpy slice at once, so no more than one is held twice
    model.update(tree_unflatten([(path, mx.array(value)) for path, value in read_local(source, shapes, local_index)]))
    mx.eval(model.parameters())
