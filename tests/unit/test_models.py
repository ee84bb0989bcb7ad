"""The MLX and torch Llamas compute what transformers' LlamaForCausalLM computes, under HF's names."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers

import mlx_impl.model as mlx_model
import torch_impl.model as torch_model
from common.model.spec import ModelSpec
from common.model.weights import init_weights, parameter_shapes, save_pretrained

ATOL = 1e-4

SPECS = {
    "mha-untied": ModelSpec(vocab_size=257, dim=32, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=48,
                            max_seq_len=64),
    "gqa-tied": ModelSpec(vocab_size=1001, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=80,
                          max_seq_len=64, tie_embeddings=True, norm_eps=1e-6),
    "mqa-theta500k": ModelSpec(vocab_size=300, dim=64, n_layers=1, n_heads=8, n_kv_heads=1, ffn_dim=96,
                               max_seq_len=32, rope_theta=500000.0),
    "gqa-head32-tied": ModelSpec(vocab_size=131, dim=64, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=128,
                                 max_seq_len=32, tie_embeddings=True, rope_theta=500000.0),
    "gqa-head16-eps6": ModelSpec(vocab_size=509, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64,
                                 max_seq_len=128, norm_eps=1e-6),
    "mha-head8-tied": ModelSpec(vocab_size=97, dim=16, n_layers=2, n_heads=2, n_kv_heads=2, ffn_dim=40,
                                max_seq_len=32, tie_embeddings=True),
}
BACKENDS = {"mlx": mlx_model, "torch": torch_model}


def random_weights(spec: ModelSpec, seed: int = 0) -> dict[str, np.ndarray]:
    """Seed weights made harder to match: norm gains away from 1 so a wrong or missing norm weight shows,
    and larger q/k so attention is peaked rather than near uniform, where RoPE mistakes would hide."""
    weights = init_weights(spec, seed)
    rng = np.random.default_rng(seed + 1)
    for name, value in weights.items():
        if name.endswith("norm.weight"):
            weights[name] = (1 + 0.1 * rng.standard_normal(value.shape)).astype(np.float32)
        elif name.endswith(("q_proj.weight", "k_proj.weight")):
            weights[name] = value * np.float32(8)
    return weights


def logits(backend, model, tokens: np.ndarray, padding_mask: np.ndarray | None = None) -> np.ndarray:
    if backend is mlx_model:
        mask = None if padding_mask is None else mx.array(padding_mask)
        out = model(mx.array(tokens), mask)
        assert out.dtype == mx.float32
        return np.array(out)
    with torch.no_grad():
        mask = None if padding_mask is None else torch.from_numpy(padding_mask)
        out = model(torch.from_numpy(tokens), mask)
    assert out.dtype == torch.float32
    return out.numpy()


@pytest.fixture(scope="module", params=list(SPECS), ids=list(SPECS))
def checkpoint(request, tmp_path_factory):
    spec = SPECS[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    save_pretrained(directory, spec, random_weights(spec))
    return spec, directory


def test_logits_match_transformers_llama(checkpoint):
    spec, directory = checkpoint
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                       attn_implementation="eager").eval()
    tokens = np.random.default_rng(1).integers(0, spec.vocab_size, size=(2, 17), dtype=np.int64)
    with torch.no_grad():
        expected = hf(torch.from_numpy(tokens)).logits.numpy()
    for backend, exp in [(torch_model, "native"), (mlx_model, "native"), (mlx_model, "fused")]:
        backend.set_exp(exp)  # MLX: mx.exp or mlx_impl/fast_exp.py in softmax and SiLU (--mlx-exp)
        try:
            got = logits(backend, backend.from_pretrained(directory), tokens)
        finally:
            backend.set_exp("native")
        assert got.shape == (2, 17, spec.vocab_size)
        assert np.abs(got - expected).max() <= ATOL, (backend.__name__, exp)


@pytest.mark.parametrize("backend", BACKENDS.values(), ids=BACKENDS.keys())
def test_right_padding_leaves_real_positions_unchanged(backend):
    spec = SPECS["gqa-tied"]
    model = backend.Llama(spec)
    backend.load_weights(model, random_weights(spec))
    rng = np.random.default_rng(2)
    lengths = [11, 6]
    tokens = rng.integers(0, spec.vocab_size, size=(2, 16), dtype=np.int64)
    padding_mask = np.zeros((2, 16), dtype=np.int64)
    for row, n in enumerate(lengths):
        padding_mask[row, :n] = 1
        tokens[row, n:] = 0  # the pad id must not matter
    padded = logits(backend, model, tokens, padding_mask)
    assert np.isfinite(padded).all()
    for row, n in enumerate(lengths):
        alone = logits(backend, model, tokens[row:row + 1, :n])[0]
        assert np.abs(padded[row, :n] - alone).max() <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS.values(), ids=BACKENDS.keys())
def test_left_padding_gives_finite_logits(backend):
    spec = SPECS["mha-untied"]
    mx.random.seed(0)
    torch.manual_seed(0)
    model = backend.Llama(spec)
    padding_mask = np.array([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=np.int64)
    tokens = np.ones((2, 6), dtype=np.int64)
    assert np.isfinite(logits(backend, model, tokens, padding_mask)).all()


@pytest.mark.parametrize("backend", BACKENDS.values(), ids=BACKENDS.keys())
@pytest.mark.parametrize("name", ["mha-untied", "gqa-tied"])
def test_parameters_have_hf_names_and_shapes_and_round_trip(backend, name):
    spec = SPECS[name]
    model = backend.Llama(spec)
    weights = random_weights(spec, seed=3)
    backend.load_weights(model, weights)
    got = backend.weights_of(model)
    assert {k: v.shape for k, v in got.items()} == parameter_shapes(spec)
    assert list(got) == list(parameter_shapes(spec))
    for k, v in weights.items():
        assert got[k].dtype == np.float32
        np.testing.assert_array_equal(got[k], v)


def test_torch_rope_tables_stay_out_of_state_dict():
    spec = SPECS["mha-untied"]
    assert list(torch_model.Llama(spec).state_dict()) == list(parameter_shapes(spec))


@pytest.mark.parametrize("backend", BACKENDS.values(), ids=BACKENDS.keys())
def test_tied_model_ignores_a_stray_lm_head(backend):
    spec = SPECS["gqa-tied"]
    model = backend.Llama(spec)
    weights = random_weights(spec)
    stray = np.zeros((spec.vocab_size, spec.dim), np.float32)
    backend.load_weights(model, {**weights, "lm_head.weight": stray})
    assert "lm_head.weight" not in backend.weights_of(model)


@pytest.mark.parametrize("backend", BACKENDS.values(), ids=BACKENDS.keys())
def test_load_weights_rejects_wrong_shape_and_missing_tensor(backend):
    spec = SPECS["mha-untied"]
    model = backend.Llama(spec)
    weights = random_weights(spec)
    bad = {**weights, "model.layers.0.self_attn.k_proj.weight": np.zeros((8, spec.dim), np.float32)}
    with pytest.raises(Exception):
        backend.load_weights(model, bad)
    missing = {k: v for k, v in weights.items() if k != "model.norm.weight"}
    with pytest.raises(Exception):
        backend.load_weights(model, missing)


@pytest.mark.parametrize("exp", ["native", "fused"])
def test_mlx_cross_entropy_matches_torch_in_value_and_gradient(exp):
    """mlx_impl.step.cross_entropy writes logsumexp out (so its backward reuses the forward's exponentials):
    it must equal torch's F.cross_entropy, gradient included, also for logits far from zero, where a
    missing max shift would overflow. Measured against torch: sum 1.4e-7 relative (nn.losses.cross_entropy:
    6.9e-8), gradients 4.4e-6 relative at most (the same for nn.losses.cross_entropy: MLX's exp); with the
    fused exp (--mlx-exp fused) the same tolerances hold."""
    import mlx.nn as nn
    import torch.nn.functional as F

    from mlx_impl.step import cross_entropy

    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((64, 1001)) * 4 + np.array([[0.0], [300.0]]).repeat(32, 0)).astype(np.float32)
    targets = rng.integers(0, 1001, 64)
    mlx_model.set_exp(exp)
    try:
        value, grad = mx.value_and_grad(lambda z: cross_entropy(z, mx.array(targets)).sum())(mx.array(logits))
    finally:
        mlx_model.set_exp("native")
    reference = torch.from_numpy(logits).requires_grad_()
    expected = F.cross_entropy(reference, torch.from_numpy(targets), reduction="sum")
    expected.backward()
    assert np.isfinite(np.array(grad)).all()
    np.testing.assert_allclose(value.item(), expected.item(), rtol=1e-6)
    np.testing.assert_allclose(np.array(grad), reference.grad.numpy(), rtol=1e-5, atol=1e-9)
    per_token = np.array(cross_entropy(mx.array(logits), mx.array(targets)))
    np.testing.assert_allclose(per_token, np.array(nn.losses.cross_entropy(mx.array(logits), mx.array(targets))),
                               rtol=1e-5)
