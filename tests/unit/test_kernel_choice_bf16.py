"""--mlx-bf16-matmul fp32 (mlx_impl/model.py `matmul`): bfloat16 operands upcast exactly, one float32 matmul,
the result rounded once to bfloat16. Its values and its gradients are those of MLX's own bf16 matmul (both
accumulate in float32 and round once), and a float32 matmul is left alone."""
from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from mlx_impl import model  # noqa: E402  (after the skip: MLX may be missing)

pytestmark = pytest.mark.usefixtures("kernels_measured")  # `auto` itself: the suite's pin lifted


def operands(rows=96, n_in=64, n_out=48):
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((rows, n_in)).astype(np.float32)).astype(mx.bfloat16)
    w = mx.array(rng.standard_normal((n_out, n_in)).astype(np.float32))  # a float32 master weight, cast at use
    return x, w


def linear(kind):
    return lambda x, w: model.matmul(x, w.astype(x.dtype).T, kind).astype(mx.float32).sum() * 0.5


def test_the_fp32_route_gives_the_bf16_matmuls_values():
    x, w = operands()
    native, fp32 = (model.matmul(x, w.astype(x.dtype).T, kind) for kind in ("native", "fp32"))
    assert fp32.dtype == mx.bfloat16
    assert np.array_equal(np.array(fp32.astype(mx.float32)), np.array(native.astype(mx.float32)))


def test_the_fp32_routes_gradients_round_once_like_the_bf16_matmuls():
    x, w = operands()
    native = mx.grad(linear("native"), argnums=(0, 1))(x, w)
    fp32 = mx.grad(linear("fp32"), argnums=(0, 1))(x, w)
    for a, b in zip(native, fp32):
        assert a.dtype == b.dtype  # x's gradient in bfloat16, the weight's in float32 (from its bf16 cast)
        assert np.array_equal(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32)))
    # The weight's gradient went through one bfloat16 rounding: every value is a bfloat16.
    grad_w = np.array(fp32[1])
    assert np.array_equal(grad_w, np.array(fp32[1].astype(mx.bfloat16).astype(mx.float32)))


def test_float32_matmuls_are_left_alone():
    x, w = operands()
    x = x.astype(mx.float32)
    out = model.matmul(x, w.T, "fp32")
    assert out.dtype == mx.float32
    assert np.array_equal(np.array(out), np.array(x @ w.T))


def test_the_set_route_reaches_linear_and_the_tied_head():
    x, w = operands()
    layer = model.Linear(64, 48, bias=False)
    layer.weight = w
    embedding = model.Embedding(48, 64)
    embedding.weight = w
    try:
        outs = {}
        for kind in model.BF16_MATMUL_KINDS:
            model.set_bf16_matmul(kind)
            outs[kind] = (np.array(layer(x).astype(mx.float32)), np.array(embedding.as_linear(x).astype(mx.float32)))
    finally:
        model.set_bf16_matmul("native")
    for a, b in zip(outs["native"], outs["fp32"]):
        assert np.array_equal(a, b)
    with pytest.raises(ValueError):
        model.set_bf16_matmul("fp16")


def test_tensor_parallels_row_parallel_layer_goes_through_the_models_matmul(monkeypatch):
    """o_proj and down_proj under tp (mlx_impl/tp.py RowParallelLinear) take the same bf16 route as Linear."""
    from types import SimpleNamespace

    from mlx_impl import tp

    calls = []

    def spy(a, b, bf16_kind=None):
        calls.append((a.dtype, b.dtype))
        return model.matmul(a, b, bf16_kind)

    monkeypatch.setattr(tp, "matmul", spy)
    x, w = operands()
    plain = model.Linear(64, 48, bias=False)
    plain.weight = w
    shards = SimpleNamespace(group=mx.distributed.init(), size=1, counter=SimpleNamespace(add=lambda y: None))
    layer = tp.RowParallelLinear.from_sharded(plain, shards)
    assert np.array_equal(np.array(layer(x).astype(mx.float32)), np.array(plain(x).astype(mx.float32)))
    assert calls == [(mx.bfloat16, mx.bfloat16)]
