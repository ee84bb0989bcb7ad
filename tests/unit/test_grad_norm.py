"""The gradient norm both frameworks clip with: precise (float64-exact to ~1e-9 where a flat float32 sum
drifts) and cheap (torch: no float64 copy of every gradient; issue 27's harness cost)."""
from __future__ import annotations

import numpy as np
import torch

from torch_impl.grads import sum_of_squares


def test_torch_sum_of_squares_is_float64_exact_where_a_flat_float32_norm_drifts():
    g = torch.Generator().manual_seed(0)
    # An embedding-sized gradient with a mean, where a float32 accumulation drifts; an odd size leaves a tail.
    x = torch.randn(3_000_001, generator=g) * 1e-3 + 2e-4
    exact = float((x.double() ** 2).sum())
    assert abs(float(sum_of_squares(x)) - exact) / exact < 1e-8
    assert sum_of_squares(x).dtype == torch.float64
    flat32 = float(torch.linalg.vector_norm(x)) ** 2  # what one float32 norm per tensor gives
    assert abs(flat32 - exact) / exact > 1e-6
    small = torch.arange(10.0).reshape(2, 5)
    assert np.isclose(float(sum_of_squares(small, width=4)), np.sum(np.arange(10.0) ** 2), rtol=1e-7)
    assert float(sum_of_squares(torch.zeros(0))) == 0.0


def test_mlx_squares_of_many_tensors_is_close_to_float64():
    """MLX's norm of many tensors at once (row sums, then one tree): odd sizes, an empty tensor and a tensor with a
    mean, as close to float64 as the tree per tensor it replaced (the clip coefficient depends on it)."""
    import mlx.core as mx

    from mlx_impl.grads import squares_of, sum_of_squares

    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s).astype(np.float32) * 1e-3 + 2e-4
              for s in [(1051, 64), (64,), (3, 5, 7), (1,), (0,), (2_000_003,), (176, 64)]]
    exact = sum(float(np.sum(a.astype(np.float64) ** 2)) for a in arrays)
    got = float(squares_of(mx.array(a) for a in arrays))
    assert abs(got - exact) / exact < 1e-7
    assert float(squares_of([])) == 0.0
    assert np.isclose(float(sum_of_squares(mx.arange(10.0).reshape(2, 5))), 285.0, rtol=1e-7)
