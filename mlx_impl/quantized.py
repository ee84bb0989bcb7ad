"""A quantized frozen base in MLX (QLoRA): the modules common/model/quantize.py names swapped for quantized ones
that run MLX's quantized matmul. Mirrors torch_impl/quantized.py.

`quantize_base` replaces each quantized Linear (and the embedding) of a model built by model.py with one holding
the packed uint32 `weight`, `scales` and `biases` under the same HF path, placeholders the strategy's load fills
from the quantized seed (mlx_impl/load.py), before lora.py attaches the adapters: a QuantizedLinear carries them
as model.Linear does. On a Metal GPU, MLX's quantized matmul computes x (s * q + b)^T from the packed words; on a
CPU the matrix is dequantized at use and multiplied by the BLAS (`dequantized_product`), as torch's twin does.
Either way the gradient reaches x (and the adapters), never the base. With a float32 base
(common/model/quantize.py FullPrecision) it changes nothing.
"""
from __future__ import annotations

import functools

import mlx.core as mx
import mlx.nn as nn

from common.model.quantize import BaseStorage, Quantization
from common.model.spec import ModelSpec

from .lora import _module, adapted


class QuantizedLinear(nn.Module):
    """y = x (s * q + b)^T (+ bias) (+ LoRA's scale * (x A^T) B^T), the scales and biases cast to x's dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool, storage: Quantization):
        super().__init__()
        shapes = storage.shapes((out_features, in_features))
        self.weight = mx.zeros(shapes["weight"], dtype=mx.uint32)
        self.scales, self.biases = mx.zeros(shapes["scales"]), mx.zeros(shapes["biases"])
        if bias:
            self.bias = mx.zeros((out_features,))
        self.group_size, self.bits = storage.group_size, storage.bits

    def base_product(self, x: mx.array) -> mx.array:
        if mx.default_device() == mx.gpu:
            return mx.quantized_matmul(x, self.weight, self.scales.astype(x.dtype), self.biases.astype(x.dtype),
                                       transpose=True, group_size=self.group_size, bits=self.bits)
        return dequantized_product(self.bits, self.group_size)(x, self.weight, self.scales, self.biases)

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base_product(x)
        if "bias" in self:
            y = y + self.bias.astype(x.dtype)
        return adapted(self, x, y)  # LoRA's term, as model.Linear adds it


class QuantizedEmbedding(QuantizedLinear):
    """The embedding's rows dequantized at lookup (float32, as model.Embedding's), and the tied head's product."""

    def __init__(self, num_embeddings: int, dims: int, storage: Quantization):
        super().__init__(dims, num_embeddings, False, storage)

    def __call__(self, tokens: mx.array) -> mx.array:
        return dequantize(self.weight[tokens], self.scales[tokens], self.biases[tokens], self.bits, self.group_size)

    def as_linear(self, x: mx.array) -> mx.array:
        return self.base_product(x)


def dequantize(weight: mx.array, scales: mx.array, biases: mx.array, bits: int, group_size: int) -> mx.array:
    """s * q + b of packed rows with their scales and biases (MLX's own kernel), in their dtype."""
    return mx.dequantize(weight, scales, biases, group_size=group_size, bits=bits)


def blocks(weight, scales, biases, bits: int, group_size: int, dtype, after: list):
    """Each block of rows (Quantization.row_blocks) dequantized, one at a time as the products use them: each after
    `after[-1]` (the product's input, then the previous block's product), which the caller appends to. MLX would
    otherwise dequantize every block of every layer as soon as it reads the graph (a dequantize depends on nothing
    but the packed words) and hold them all until their products: the float32 base again, at the step's peak."""
    for start, stop in Quantization(bits, group_size).row_blocks(weight.shape[0], scales.shape[1] * group_size):
        w, s, b = mx.depends([weight[start:stop], scales[start:stop], biases[start:stop]], [after[-1]])
        yield start, stop, dequantize(w, s, b, bits, group_size).astype(dtype)


@functools.cache
def dequantized_product(bits: int, group_size: int):
    """x (s * q + b)^T on a CPU: the matrix dequantized (float32) and handed to the BLAS, as torch does it. MLX's CPU
    quantized matmul has no BLAS behind it: 35-60x slower than this at (512, 2048) x (2048, 2048)
    (benchmarks/bench_quantized.py). A block of rows at a time (Quantization.row_blocks), and the backward
    dequantizes again instead of keeping each matrix from the forward to the backward, which would hold the float32
    base at the step's peak."""

    @mx.custom_function
    def product(x, weight, scales, biases):
        parts = [x]
        for _, _, w in blocks(weight, scales, biases, bits, group_size, x.dtype, parts):
            parts.append(x @ w.T)
        return parts[1] if len(parts) == 2 else mx.concatenate(parts[1:], axis=-1)

    @product.vjp
    def product_vjp(primals, cotangent, output):
        x, weight, scales, biases = primals
        grads = [cotangent]
        for start, stop, w in blocks(weight, scales, biases, bits, group_size, cotangent.dtype, grads):
            part = cotangent[..., start:stop] @ w
            grads.append(part if len(grads) == 1 else grads[-1] + part)
        grad = grads[-1]
        # the base is frozen: its cotangents are never evaluated (MLX is lazy), only shaped
        return grad, mx.zeros_like(weight), mx.zeros_like(scales), mx.zeros_like(biases)

    return product


def quantize_base(model: nn.Module, storage: BaseStorage, spec: ModelSpec) -> None:
    """Swap every module `storage` quantizes for its quantized twin (placeholders: the load fills them)."""
    for path in storage.modules(spec):
        parent_path, _, name = path.rpartition(".")
        parent, old = _module(model, parent_path) if parent_path else model, _module(model, path)
        assert isinstance(storage, Quantization)
        if isinstance(old, nn.Embedding):
            new: nn.Module = QuantizedEmbedding(old.weight.shape[0], old.weight.shape[1], storage)
        else:
            new = QuantizedLinear(old.weight.shape[1], old.weight.shape[0], "bias" in old, storage)
        if isinstance(parent, list):
            parent[int(name)] = new
        else:
            setattr(parent, name, new)
