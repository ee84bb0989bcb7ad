"""A quantized frozen base in PyTorch (QLoRA): the modules common/model/quantize.py names swapped for quantized
ones that compute on exactly the dequantized values MLX's quantized matmul uses. Mirrors mlx_impl/quantized.py.

`quantize_base` replaces each quantized Linear (and the embedding) of a model built by model.py with one holding
the packed `weight` (MLX's uint32 words, held as int32: the same bits), `scales` and `biases` under the same HF
path, frozen parameters the strategy's load fills from the quantized seed (torch_impl/load.py), before lora.py
attaches the adapters: a QuantizedLinear carries them as model.Linear does. torch has no kernel for MLX's
layout, so each product dequantizes s * q + b (float32, as MLX's kernel) a block of rows at a time and runs
F.linear; the backward dequantizes again rather than keep the float32 matrix from the forward, so a rank holds the
packed base and one block at a time, not the float32 base. With a float32 base (FullPrecision) it changes nothing.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from common.model.quantize import BaseStorage, Quantization
from common.model.spec import ModelSpec

from .lora import adapted


def dequantize(weight: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int,
               group_size: int) -> torch.Tensor:
    """s * q + b of packed rows (..., words) with their (..., groups) scales and biases, in float32."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=weight.device)
    codes = (weight.unsqueeze(-1) >> shifts) & (2 ** bits - 1)  # (..., words, 32 / bits), lowest bits first
    codes = codes.reshape(*weight.shape[:-1], scales.shape[-1], group_size).to(scales.dtype)
    return (codes * scales.unsqueeze(-1) + biases.unsqueeze(-1)).flatten(-2)


def blocks(weight, scales, biases, bits: int, group_size: int, dtype, after: list):
    """Each block of rows (Quantization.row_blocks) dequantized, one at a time as the products use them (torch runs
    in program order: `after`, what MLX's must wait for, orders nothing here)."""
    for start, stop in Quantization(bits, group_size).row_blocks(weight.shape[0], scales.shape[1] * group_size):
        yield start, stop, dequantize(weight[start:stop], scales[start:stop], biases[start:stop], bits,
                                      group_size).to(dtype)


class QuantizedProduct(torch.autograd.Function):
    """x (s * q + b)^T a block of rows at a time, its backward dequantizing again (only x has a gradient: the base
    is frozen)."""

    @staticmethod
    def forward(ctx, x, weight, scales, biases, bits, group_size):
        ctx.save_for_backward(weight, scales, biases)
        ctx.bits, ctx.group_size = bits, group_size
        parts = [F.linear(x, w) for _, _, w in blocks(weight, scales, biases, bits, group_size, x.dtype, [x])]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        weight, scales, biases = ctx.saved_tensors
        out = None
        for start, stop, w in blocks(weight, scales, biases, ctx.bits, ctx.group_size, grad.dtype, [grad]):
            part = grad[..., start:stop] @ w
            out = part if out is None else out.add_(part)
        return out, None, None, None, None, None


class QuantizedLinear(nn.Module):
    """y = x (s * q + b)^T (+ bias) (+ LoRA's scale * (x A^T) B^T)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, storage: Quantization):
        super().__init__()
        shapes = storage.shapes((out_features, in_features))
        self.weight = nn.Parameter(torch.zeros(shapes["weight"], dtype=torch.int32), requires_grad=False)
        self.scales = nn.Parameter(torch.zeros(shapes["scales"]), requires_grad=False)
        self.biases = nn.Parameter(torch.zeros(shapes["biases"]), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.group_size, self.bits = storage.group_size, storage.bits

    def base_product(self, x: torch.Tensor) -> torch.Tensor:
        return QuantizedProduct.apply(x, self.weight, self.scales, self.biases, self.bits, self.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_product(x)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return adapted(self, x, y)  # LoRA's term, as model.Linear adds it


class QuantizedEmbedding(QuantizedLinear):
    """The embedding's rows dequantized at lookup (float32, as model.Embedding's), and the tied head's product."""

    def __init__(self, num_embeddings: int, dims: int, storage: Quantization):
        super().__init__(dims, num_embeddings, False, storage)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return dequantize(self.weight[tokens], self.scales[tokens], self.biases[tokens], self.bits, self.group_size)

    def as_linear(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_product(x)


def quantize_base(model: nn.Module, storage: BaseStorage, spec: ModelSpec) -> None:
    """Swap every module `storage` quantizes for its quantized twin (placeholders: the load fills them)."""
    for path in storage.modules(spec):
        parent_path, _, name = path.rpartition(".")
        parent, old = model.get_submodule(parent_path), model.get_submodule(path)
        assert isinstance(storage, Quantization)
        if isinstance(old, nn.Embedding):
            new: nn.Module = QuantizedEmbedding(old.weight.shape[0], old.weight.shape[1], storage)
        else:
            new = QuantizedLinear(old.weight.shape[1], old.weight.shape[0], old.bias is not None, storage)
        parent.register_module(name, new)
