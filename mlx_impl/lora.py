"""LoRA in MLX: the adapters of common/model/lora.py attached to the model's Linears, the rest frozen. Mirrors
torch_impl/lora.py.

`attach` gives each adapted Linear (model.py) two more parameters, `lora_A` (rank, in) and `lora_B` (out, rank),
under its HF path, placeholders the strategy's load fills from the run's source (their initial values, or a
checkpoint's), and its `lora_scale`; then freezes every parameter that does not train, so that
`trainable_parameters()` (what nn.value_and_grad differentiates, AdamW holds and ddp all-reduces) is the
adapters alone. With every parameter trained (common/model/lora.py FullModel) it changes nothing.
"""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from common.model.lora import Trained
from common.model.spec import ModelSpec


def attach(model: nn.Module, trained: Trained, spec: ModelSpec) -> None:
    modules = trained.modules(spec)
    if not modules:
        return
    shapes = trained.state_shapes(spec)
    for path in modules:
        linear = _module(model, path)
        linear.lora_A = mx.zeros(shapes[path + ".lora_A"])
        linear.lora_B = mx.zeros(shapes[path + ".lora_B"])
        linear.lora_scale = trained.scale
    model.freeze()
    for path in modules:
        _module(model, path).unfreeze(recurse=False, keys=["lora_A", "lora_B"])


def _module(model: nn.Module, path: str) -> nn.Module:
    node = model
    for part in path.split("."):
        node = node[int(part)] if isinstance(node, list) else getattr(node, part)
    return node


def adapted(module: nn.Module, x: mx.array, y: mx.array) -> mx.array:
    """y, plus scale * (x A^T) B^T where `attach` gave `module` adapters (in the input's dtype, as the weight): what an
    adapted Linear (model.py) or a quantized one (quantized.py) adds to its base product."""
    if "lora_A" not in module:
        return y
    return y + ((x @ module.lora_A.astype(x.dtype).T) @ module.lora_B.astype(x.dtype).T) * module.lora_scale
