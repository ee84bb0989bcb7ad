"""MLX's float32 attention core on a CPU (mlx_impl/model.py `_attend`, `_row_max`): the rewrites issue 58 kept for
speed compute what the step-by-step form computes, forward and backward, with grouped-query heads and a padding
mask, to float32 rounding of a float64 reference."""
from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from mlx_impl import model  # noqa: E402  (after the skip: MLX may be missing)

pytestmark = pytest.mark.usefixtures("kernels_measured")  # `auto` itself: the suite's pin lifted


@pytest.mark.parametrize("length", [1, 7, 8, 9, 16, 17, 100, 127, 128, 1051])
def test_the_row_max_tree_gives_maxs_values(length):
    x = np.random.default_rng(length).standard_normal((3, 2, length)).astype(np.float32)
    x[0, 0, : length // 2] = -np.inf  # masked positions, as the scores carry them
    assert np.array_equal(np.array(model._row_max(mx.array(x))), x.max(axis=-1, keepdims=True))


def reference(q, k, v, mask, scale):
    """softmax(q k^T scale, masked) v in float64, k and v repeated over their query heads."""
    groups = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)
    scores = np.where(mask, np.einsum("bhtd,bhsd->bhts", q, k) * scale, -np.inf)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return np.einsum("bhts,bhsd->bhtd", p / p.sum(axis=-1, keepdims=True), v)


@pytest.fixture(params=list(model.ATTENTION_BLOCKS))
def blocks(request):
    """Each of the attention core's block counts auto chooses between (model.set_attention), set while traced."""
    model.set_attention(request.param)
    yield request.param
    model.set_attention("whole")


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("T", [24, 23])
def test_the_attention_core_and_its_gradients_match_a_float64_reference(kv_heads, padded, T, blocks):
    """Whole or in blocks of queries (a length the blocks do not divide too): the same values and gradients."""
    rng = np.random.default_rng(0)
    B, H, D = 2, 4, 8
    q, k, v = (rng.standard_normal((B, h, T, D)) for h in (H, kv_heads, kv_heads))
    cotangent = rng.standard_normal((B, H, T, D))
    padding = np.ones((B, T), dtype=np.int32)
    if padded:
        padding[1, :5] = 0  # left padding in the second sequence
    mask = model.attention_mask(mx.array(padding), T) if padded else "causal"
    np_mask = np.array(mask) if padded else np.tril(np.ones((T, T), dtype=bool))
    if np_mask.ndim == 4:
        np_mask = np.broadcast_to(np_mask, (B, H, T, T))
    scale = D ** -0.5

    def loss(q, k, v):
        return (model.attention(q, k, v, scale, mask) * mx.array(cotangent, dtype=mx.float32)).sum()

    args = [mx.array(a, dtype=mx.float32) for a in (q, k, v)]
    out = model.attention(*args, scale, mask)
    grads = mx.grad(loss, argnums=(0, 1, 2))(*args)
    assert np.allclose(np.array(out), reference(q, k, v, np_mask, scale), rtol=0, atol=2e-6)
    eps = 1e-6
    for i, grad in enumerate(grads):  # central differences of the float64 reference, along a random direction
        direction = rng.standard_normal(args[i].shape)
        plus = [q, k, v]
        minus = [q, k, v]
        plus[i] = plus[i] + eps * direction
        minus[i] = minus[i] - eps * direction
        numeric = ((reference(*plus, np_mask, scale) - reference(*minus, np_mask, scale)) * cotangent).sum() / (2 * eps)
        assert float((np.array(grad) * direction).sum()) == pytest.approx(numeric, rel=1e-4, abs=1e-4)


@pytest.mark.parametrize("exp_kind", model.EXP_KINDS)
@pytest.mark.parametrize("vocab", [1051, 4099])
def test_every_cross_entropy_shift_gives_the_same_losses_and_gradients(exp_kind, vocab):
    """The forms auto chooses between (model.set_cross_entropy) differ in speed, not in the losses: the max is
    exact whichever way it is taken, and x - max is the same subtraction inside the exp's kernels or before."""
    rng = np.random.default_rng(1)
    logits = mx.array((4 * rng.standard_normal((64, vocab))).astype(np.float32))
    targets = mx.array(rng.integers(0, vocab, 64).astype(np.int32))

    def run(kind):
        f = mx.compile(mx.value_and_grad(lambda x: model._cross_entropy(x, targets, kind, exp_kind).sum()))
        loss, grad = f(logits)
        return np.array(model._cross_entropy(logits, targets, kind, exp_kind)), np.array(grad)

    losses, grads = run("native")
    for kind in model.CROSS_ENTROPY_KINDS:
        kind_losses, kind_grads = run(kind)
        assert np.array_equal(kind_losses, losses), kind
        np.testing.assert_allclose(kind_grads, grads, rtol=1e-6, atol=1e-12)
