"""--dtype bfloat16 is real mixed precision in both frameworks, on the CPU too: bf16 compute from float32
master weights, within the documented tolerances of float32 (common/model/precision.py, docs/precision.md)."""
from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest
import torch

import mlx_impl.model as mlx_model
import mlx_impl.step as mlx_step
import torch_impl.model as torch_model
import torch_impl.step as torch_step
from common.config import DTYPES, RunConfig
from common.train.loop import World
from common.model.precision import DEFAULT_TOLERANCES, POLICIES, describe
from common.model.spec import ModelSpec
from common.model.weights import init_weights, num_parameters, parameter_shapes

BF16 = DEFAULT_TOLERANCES["bfloat16"]
FRAMEWORKS = ["mlx", "torch"]
TRAINERS = {"mlx": mlx_step.Trainer, "torch": torch_step.Trainer}
MODELS = {"mlx": mlx_model, "torch": torch_model}
SPEC = ModelSpec(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32)


def batch(seed: int = 0, B: int = 4, T: int = 16):
    rows = np.random.default_rng(seed).integers(0, SPEC.vocab_size, size=(B, T + 1), dtype=np.int32)
    return rows[:, :-1], rows[:, 1:], np.ones((B, T), dtype=np.float32)


def train_losses(framework: str, dtype: str, steps: int = 4) -> list[float]:
    cfg = RunConfig(framework=framework, dtype=dtype, lr=3e-3)
    trainer = TRAINERS[framework](cfg, SPEC, init_weights(SPEC, 0), World())
    out = []
    for step in range(steps):
        inputs, targets, mask = batch(step)
        out.append(trainer.train_step([(inputs, targets, mask)], 3e-3, int(mask.sum()))[0])
    weights, exp_avg, exp_avg_sq = (dict(stream) for stream in trainer.export_state())
    assert weights.keys() == exp_avg.keys() == exp_avg_sq.keys() == parameter_shapes(SPEC).keys()
    held = trainer.state_bytes()  # master weights and moments stay float32 under bf16 (common/model/precision.py)
    assert held["params"] == 4 * num_parameters(SPEC) and held["optimizer"] >= 8 * num_parameters(SPEC)
    return out


@pytest.fixture
def mlx_uncompiled():
    """MLX without mx.compile for one test. On a CPU every kernel mx.compile fuses is C++ that MLX builds with
    g++ (about 0.8 s each, 55 for an fp32 and a bf16 trainer: 42 s of a cold unit lane, AMD EPYC Zen 4) and
    keeps under $TMPDIR/mlx/. Compiled or not, the same operations round to the same dtypes (a fused
    kernel keeps each bf16 intermediate in bf16), so what the trainer computes in which dtype is tested
    without them; the compiled bf16 path against float32 is tests/integration/test_bf16.py's
    test_bf16_runs_differ_from_fp32_and_stay_within_the_documented_tolerance, on the compare it runs anyway."""
    mx.disable_compile()
    yield
    if not os.environ.get("MLX_DISABLE_COMPILE"):
        mx.enable_compile()


# ---- fast: in-process ---------------------------------------------------------------------------------

@pytest.mark.usefixtures("mlx_uncompiled")
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_bfloat16_trainer_computes_something_else_than_float32(framework):
    """The silent-fp32 bug: a bf16 run whose losses equal the fp32 run's to the last digit."""
    fp32, bf16 = train_losses(framework, "float32"), train_losses(framework, "bfloat16")
    assert np.abs(np.subtract(bf16, fp32)).max() > 1e-6, "bfloat16 computed in float32"
    np.testing.assert_allclose(bf16, fp32, rtol=BF16["vs_fp32_curve_rtol"])


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_bf16_logits_come_from_float32_master_weights_whose_gradients_are_float32(framework):
    module = MODELS[framework]
    model = module.Llama(SPEC, compute_dtype="bfloat16")
    module.load_weights(model, init_weights(SPEC, 0))
    inputs, targets, mask = batch()
    if framework == "mlx":
        import mlx.nn as nn

        assert model(mx.array(inputs)).dtype == mx.bfloat16
        _, grads = nn.value_and_grad(model, mlx_step.token_loss_sum)(model, mx.array(inputs), mx.array(targets),
                                                                   mx.array(mask))
        from mlx.utils import tree_flatten
        dtypes = {str(g.dtype) for _, g in tree_flatten(grads)} | {str(p.dtype) for _, p in tree_flatten(model.parameters())}
        assert dtypes == {"mlx.core.float32"}
    else:
        assert model(torch.from_numpy(inputs).long()).dtype == torch.bfloat16
        torch_step.token_loss_sum(model, torch.from_numpy(inputs).long(), torch.from_numpy(targets).long(),
                                  torch.from_numpy(mask)).backward()
        assert {p.dtype for p in model.parameters()} | {p.grad.dtype for p in model.parameters()} == {torch.float32}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_mlx_and_torch_bf16_logits_agree_to_bf16_rounding(tied):
    spec = SPEC.with_(tie_embeddings=tied)
    weights, (inputs, _, _) = init_weights(spec, 0), batch()
    got = {}
    for name, module in MODELS.items():
        model = module.Llama(spec, compute_dtype="bfloat16")
        module.load_weights(model, weights)
        if name == "mlx":
            got[name] = np.array(model(mx.array(inputs)).astype(mx.float32))
        else:
            with torch.no_grad():
                got[name] = model(torch.from_numpy(inputs).long()).float().numpy()
    # A bf16 ulp of the largest logit (8 significant bits): the attention kernels round differently.
    assert np.abs(got["mlx"] - got["torch"]).max() <= 2 ** -7 * np.abs(got["torch"]).max()


def test_the_policy_and_the_tolerances_are_described_for_every_dtype():
    assert describe("float32")["compute_dtype"] == "float32"
    bf16 = describe("bfloat16")
    assert (bf16["compute_dtype"], bf16["master_dtype"], bf16["reduce_dtype"]) == ("bfloat16", "float32", "float32")
    assert set(DEFAULT_TOLERANCES) == set(POLICIES) == set(DTYPES)
    assert BF16["loss_rtol"] > 0 and BF16["vs_fp32_curve_rtol"] > 0 and BF16["dp_rtol"] > 0
