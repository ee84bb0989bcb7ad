"""A quantized frozen base (QLoRA: common/model/quantize.py, mlx_impl/quantized.py, torch_impl/quantized.py): the
numpy quantizer is MLX's, bit for bit; both frameworks' quantized modules compute on exactly the dequantized values,
and their gradients reach the input, not the base; the base holds at most 0.2x its float32 bytes; in-process
Trainers at one rank train the adapters to the same losses. (A folder written by mlx_lm.convert -q, the runs and the
exports: tests/integration/test_lora.py.)"""
import math

import mlx.core as mx
import numpy as np
import pytest
import torch
from mlx.utils import tree_flatten

from common.config import RunConfig
from common.errors import UserError
from common.model.quantize import DequantizedSource, FullPrecision, Quantization, quantize_tensors, quantized_bytes
from common.model.spec import ModelSpec, preset
from common.model.weights import init_weights, parameter_shapes
from common.checkpoint.tensorsource import DictSource
from common.train.protocols import World

# Every matrix's input side a multiple of 64, as in a real Llama, so every Linear and the embedding quantize.
SPEC = ModelSpec(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192, max_seq_len=128)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_the_numpy_quantizer_is_mlx_affine_quantize_bit_for_bit(bits, group_size):
    w = (np.random.default_rng(bits + group_size).standard_normal((48, 256)) * 0.02).astype(np.float32)
    w[3, :group_size] = 0.0  # a group of zeros: the scale's floor and a zero bias
    storage = Quantization(bits, group_size)
    packed, scales, biases = storage.quantize(w)
    expected = mx.quantize(mx.array(w), group_size=group_size, bits=bits)
    for ours, theirs in zip((packed, scales, biases), expected):
        np.testing.assert_array_equal(ours, np.array(theirs))
    dequantized = storage.dequantize(packed, scales, biases)
    np.testing.assert_array_equal(dequantized, np.array(mx.dequantize(*expected, group_size=group_size, bits=bits)))
    # near the float32 values: mostly within half a step (the edge MLX keeps exact can push the other end past)
    assert np.abs(dequantized - w).mean() <= np.abs(scales).mean() / 2
    np.testing.assert_array_equal(storage.pack(storage.unpack(packed)), packed)


def test_the_base_holds_at_most_a_fifth_of_its_float32_bytes_in_both_frameworks():
    from mlx_impl.quantized import quantize_base as mlx_quantize
    from mlx_impl.model import Llama as MlxLlama
    from torch_impl.quantized import quantize_base as torch_quantize
    from torch_impl.model import Llama as TorchLlama

    storage, fp32 = Quantization(4, 64), FullPrecision().base_bytes(SPEC)
    assert storage.modules(SPEC) == [n.removesuffix(".weight") for n, s in parameter_shapes(SPEC).items() if len(s) == 2]
    mlx_model = MlxLlama(SPEC)
    mlx_quantize(mlx_model, storage, SPEC)
    with torch.device("meta"):
        torch_model = TorchLlama(SPEC)
        torch_quantize(torch_model, storage, SPEC)
    held = {"mlx": sum(v.nbytes for _, v in tree_flatten(mlx_model.parameters())),
            "torch": sum(p.nbytes for p in torch_model.parameters())}
    assert held["mlx"] == held["torch"] == storage.base_bytes(SPEC) <= 0.2 * fp32, (held, fp32)
    assert storage.base_bytes(SPEC) == sum(quantized_bytes(s, 4, 64) if len(s) == 2 else 4 * math.prod(s)
                                           for s in parameter_shapes(SPEC).values())
    assert Quantization(8, 64).base_bytes(SPEC) <= 0.3 * fp32  # 8 bits: a quarter, plus the scales


def quantized_linear_pair(bias: bool):
    from mlx_impl.quantized import QuantizedLinear as MlxQuantized
    from torch_impl.quantized import QuantizedLinear as TorchQuantized

    storage = Quantization(4, 64)
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((96, 128)) * 0.05).astype(np.float32)
    packed, scales, biases = storage.quantize(w)
    b = rng.standard_normal(96).astype(np.float32)
    ours, theirs = MlxQuantized(128, 96, bias, storage), TorchQuantized(128, 96, bias, storage)
    ours.update({"weight": mx.array(packed), "scales": mx.array(scales), "biases": mx.array(biases),
                 **({"bias": mx.array(b)} if bias else {})})
    with torch.no_grad():
        theirs.weight.copy_(torch.from_numpy(packed.view(np.int32)))
        theirs.scales.copy_(torch.from_numpy(scales))
        theirs.biases.copy_(torch.from_numpy(biases))
        if bias:
            theirs.bias.copy_(torch.from_numpy(b))
    return ours, theirs, storage.dequantize(packed, scales, biases), b if bias else np.zeros(96, np.float32)


@pytest.mark.parametrize("bias", [False, True])
def test_both_quantized_linears_compute_on_the_dequantized_values_and_differentiate_only_the_input(bias):
    ours, theirs, dequantized, b = quantized_linear_pair(bias)
    x = np.random.default_rng(1).standard_normal((5, 128)).astype(np.float32)
    expected = x @ dequantized.T + b
    np.testing.assert_allclose(np.array(ours(mx.array(x))), expected, rtol=0, atol=2e-6)
    xt = torch.from_numpy(x).requires_grad_(True)
    out = theirs(xt)
    np.testing.assert_allclose(out.detach().numpy(), expected, rtol=0, atol=2e-6)
    (out ** 2).sum().backward()
    grad = mx.grad(lambda v: (ours(v) ** 2).sum())(mx.array(x))
    np.testing.assert_allclose(np.array(grad), 2 * expected @ dequantized, rtol=0, atol=1e-5)
    np.testing.assert_allclose(xt.grad.numpy(), 2 * expected @ dequantized, rtol=0, atol=1e-5)
    assert all(not p.requires_grad for p in theirs.parameters())


def test_a_dequantized_source_reads_a_quantized_base_as_the_float32_tensors_it_stands_for():
    storage, weights = Quantization(4, 64), init_weights(SPEC, 0)
    quantized = DictSource(quantize_tensors(storage, SPEC, weights))
    source = DequantizedSource(quantized, storage, SPEC)
    assert {n: source.shape(n) for n in source.names()} == parameter_shapes(SPEC)
    name = "model.layers.1.mlp.down_proj.weight"
    np.testing.assert_array_equal(source.read(name), storage.dequantize(
        *(quantized.read(f"model.layers.1.mlp.down_proj.{p}") for p in ("weight", "scales", "biases"))))
    assert np.abs(source.read(name) - weights[name]).max() < 0.02  # the float32 values it quantized, near
    np.testing.assert_array_equal(source.read("model.norm.weight"), weights["model.norm.weight"])


@pytest.mark.parametrize("fields, message", [
    ({"quantize_base": 4}, "a quantized base is frozen: --quantize-base .* needs --lora-rank"),
    ({"quantize_base": 3, "lora_rank": 4}, "--quantize-base 3: allowed: 4, 8 bits"),
    ({"quantize_base": 4, "quantize_group_size": 48, "lora_rank": 4}, "--quantize-group-size 48: allowed: 32, 64, 128"),
])
def test_bad_quantization_flags_are_refused_in_one_line(fields, message):
    with pytest.raises(UserError, match=message):
        RunConfig(preset="tiny", **fields).validate()


def test_a_quantized_folder_brings_its_storage_and_a_conflicting_flag_or_mode_is_refused(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"quantization": {"bits": 4, "group_size": 64}}))
    from common.model.quantize import folder_quantization

    assert folder_quantization(tmp_path) == Quantization(4, 64)
    (tmp_path / "config.json").write_text(json.dumps({"quantization": {"bits": 4, "group_size": 32, "mode": "mxfp4"}}))
    with pytest.raises(UserError, match="quantization mode 'mxfp4' is not read"):
        folder_quantization(tmp_path)


@pytest.fixture
def uncompiled_mlx():
    mx.disable_compile()  # what is checked is which values train, not the kernels (tests/unit/test_lora.py)
    yield
    mx.enable_compile()


def test_both_trainers_train_adapters_on_a_4_bit_base_to_the_same_losses(uncompiled_mlx):
    from mlx_impl.step import Trainer as MlxTrainer
    from torch_impl.step import Trainer as TorchTrainer

    losses = {}
    for framework, trainer_cls in (("mlx", MlxTrainer), ("torch", TorchTrainer)):
        cfg = RunConfig(framework=framework, preset="tiny", lr=1e-2, lora_rank=4, quantize_base=4, grad_clip=0.0,
                        model={"vocab_size": 512, "ffn_dim": 192})
        cfg.validate()
        spec = preset("tiny").__class__(**{**preset("tiny").to_dict(), "vocab_size": 512, "ffn_dim": 192})
        weights = {**quantize_tensors(cfg.base_storage, spec, init_weights(spec, 0)),
                   **cfg.trained.initial_values(spec, 0)}
        trainer = trainer_cls(cfg, spec, weights, World())
        tokens = np.random.default_rng(0).integers(0, 512, size=(4, 17)).astype(np.int32)
        batch = (tokens[:, :-1], tokens[:, 1:], np.ones((4, 16), dtype=np.float32))
        losses[framework] = [trainer.train_step([batch], 1e-2, 64)[0] for _ in range(3)]
        sizes = trainer.state_bytes()
        assert sizes["params"] == 4 * cfg.trained.trained_parameters(spec)  # the adapters alone train
    np.testing.assert_allclose(losses["mlx"], losses["torch"], rtol=0, atol=1e-5)
    assert losses["mlx"][-1] < losses["mlx"][0]


def test_a_product_dequantizes_a_block_of_rows_at_a_time_with_the_same_values(monkeypatch):
    """Blocks of rows (Quantization.row_blocks) give the product and the input's gradient of the whole matrix."""
    import common.model.quantize as quantize

    ours, theirs, dequantized, b = quantized_linear_pair(False)
    x = np.random.default_rng(3).standard_normal((5, 128)).astype(np.float32)
    monkeypatch.setattr(quantize, "BLOCK_BYTES", 40 * 128 * 4)  # 96 rows in blocks of 40, 40 and 16
    assert Quantization(4, 64).row_blocks(96, 128) == [(0, 40), (40, 80), (80, 96)]
    expected = x @ dequantized.T
    xt = torch.from_numpy(x).requires_grad_(True)
    out = theirs(xt)
    (out ** 2).sum().backward()
    from mlx_impl import quantized as mlx_quantized

    mlx_quantized.dequantized_product.cache_clear()  # built again under the small blocks
    got = ours(mx.array(x))
    grad = mx.grad(lambda v: (ours(v) ** 2).sum())(mx.array(x))
    mlx_quantized.dequantized_product.cache_clear()
    for value in (np.array(got), out.detach().numpy()):
        np.testing.assert_allclose(value, expected, rtol=0, atol=2e-6)
    for value in (np.array(grad), xt.grad.numpy()):
        np.testing.assert_allclose(value, 2 * expected @ dequantized, rtol=0, atol=1e-5)
