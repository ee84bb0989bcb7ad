"""LoRA in PyTorch: the adapters of common/model/lora.py attached to the model's Linears, the rest frozen. Mirrors
mlx_impl/lora.py.

`attach` gives each adapted Linear (model.py) two more parameters, `lora_A` (rank, in) and `lora_B` (out, rank),
under its HF path (on the meta device, as the whole model is built: the strategy's load allocates and fills
them from the run's source), and its `lora_scale`; then turns off requires_grad of every parameter that does
not train, before the strategy wraps the model, so that DDP hooks, all-reduces and AdamW hold the adapters
alone. With every parameter trained (common/model/lora.py FullModel) it changes nothing.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from common.model.lora import Trained
from common.model.spec import ModelSpec


def attach(model: nn.Module, trained: Trained, spec: ModelSpec) -> None:
    modules = trained.modules(spec)
    if not modules:
        return
    shapes = trained.state_shapes(spec)
    for path in modules:
        linear = model.get_submodule(path)
        linear.lora_A = nn.Parameter(torch.zeros(shapes[path + ".lora_A"]))
        linear.lora_B = nn.Parameter(torch.zeros(shapes[path + ".lora_B"]))
        linear.lora_scale = trained.scale
    for name, param in model.named_parameters():
        param.requires_grad_(name in shapes)


def adapted(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y, plus scale * (x A^T) B^T where `attach` gave `module` adapters (in the input's dtype, as the weight): what an
    adapted Linear (model.py) or a quantized one (quantized.py) adds to its base product."""
    if not hasattr(module, "lora_A"):
        return y
    return y + F.linear(F.linear(x, module.lora_A.to(x.dtype)), module.lora_B.to(x.dtype)) * module.lora_scale
