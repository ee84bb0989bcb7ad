"""`--mlx-exp fused`: exp written as MLX operations, so that mx.compile builds it into vectorised CPU kernels.

MLX's CPU `exp` runs one element at a time: the wheel's prebuilt kernel for baseline x86-64 (13-21 ns per
element, docs/cpu-performance.md), and inside an mx.compile kernel an out-of-line call to its scalar
`simd::exp` (4.8 ns even built with -march=native). torch's is vectorised (2.7 ns). Written here as
multiplies, adds, selects and integer shifts, every step inlines into the compiled loop, which g++ vectorises.

The method (Cody and Waite's range reduction, then a polynomial):
    k = round(x / ln 2),  r = (x - k*LN2_HI) - k*LN2_LO  (|r| <= ln2/2; k*LN2_HI is exact),
    exp(x) = 2^k * (1 + r + r^2 (c0 + c1 r) + r^4 (c2 + c3 r + c4 r^2)),
the polynomial a minimax fit of degree 6 (relative error 2.5e-8 on |r| <= ln2/2, 1.0e-7 down to r = -0.665), evaluated in Estrin's scheme
with 2^k folded into its terms, so the sum is rounded once at the result's scale. Measured against float64 on
8,001,000 points over [-88, 88]: at most 1.54 ulp (1.56 with -march=native kernels, whose g++ contracts
multiplies and adds into FMAs; tests/unit/test_fast_exp.py). MLX's own: 5.9e6 ulp near -87.7,
where it flushes to zero too early.

Two kernels, not one: mx.compile fuses at most 11 operations deep (MLX's max_compile_depth) and 2^k needs its
float bits built as an integer and reinterpreted (mx.view, which it does not fuse). So the first kernel writes
the bits of 2^k, the view is free, and the second kernel recomputes x - shift and reads k back from the bits.
The two kernels must share no intermediate array, or MLX would write it out as a third: the first one scales
x and the shift by 1/ln 2 separately, the second subtracts them. Below -88.72 the result is 0 (as it is for MLX's
own exp below -88); +inf, -inf and NaN give inf, 0 and NaN. Above 88.38, k stays 127 and r leaves the
polynomial's range: 1.4e-5 relative at worst up to 88.72, where float32 overflows (softmax and cross-entropy
never get there: they exponentiate x - max <= 0).

The bits of 2^k are one more array the size of x; against MLX's -march=native exp, its fresh pages cost about what
the vectorised arithmetic saves, so --mlx-exp auto uses this only where it measured faster: with baseline
kernels (common/kernels.py resolved_mlx_exp; docs/cpu-performance.md, benchmarks/bench_exp.py).

The gradient is the output times the cotangent (mx.custom_function), as for MLX's exp: the backward never
differentiates the polynomial.
"""
from __future__ import annotations

from typing import cast

import mlx.core as mx

LOG2E = 1.4426950408889634
LN2_HI = 0.693145751953125      # 12 significant bits: k * LN2_HI is exact for |k| < 2^12
LN2_LO = 1.428606765330187e-06  # ln 2 - LN2_HI
# exp(r) = 1 + r + r^2 (C0 + C1 r) + r^4 (C2 + C3 r + C4 r^2): minimax, relative error weighted 4x lighter on
# [-0.665, -0.347], the r the clamped k = -126 leaves for the subnormal results of x in [-88, -87.34].
C0, C1, C2, C3, C4 = 0.49999895691871643, 0.16666848957538605, 0.0416954942047596, 0.008336883969604969, \
    0.001219433848746121
X_ZERO = -88.72                 # exp is 0 below (2^k would be subnormal); -inf goes through here
K_MIN, K_MAX = -126, 127        # 2^k stays a normal float32
BIAS = 127.0
ROUNDER = 1.5 * 2.0 ** 23       # t + ROUNDER keeps no fraction bits (|t| < 2^22)
MANTISSA_SCALE = 2.0 ** -23     # float(bits) * 2^-23 = k + 127, exactly: bits < 2^31 with 8 significant bits


def _power_bits(x: mx.array, shift: mx.array | None, sign: float) -> mx.array:
    """Kernel 1: the int32 bits of 2^k as a float32, k = round((sign x - shift) / ln 2); 0 below X_ZERO."""
    t = x * (sign * LOG2E)
    if shift is not None:
        t = t - shift * LOG2E
    k = (t + ROUNDER) - ROUNDER  # round to nearest with two adds: mx.round is a libm call without SSE4.1
    # where, not clip or maximum: those test for NaN with a branch, which keeps g++ from vectorising the loop
    k = mx.where(k < K_MIN, K_MIN, mx.where(k > K_MAX, K_MAX, k)).astype(mx.int32)
    bits = mx.left_shift(k + int(BIAS), 23)
    return mx.where(t < X_ZERO * LOG2E, mx.array(0, dtype=mx.int32), bits)


def _exp(x: mx.array, shift: mx.array | None, sign: float) -> mx.array:
    bits = _power_bits(x, shift, sign)
    scale = mx.view(bits, mx.float32)              # 2^k, or 0
    # Kernel 2. k * LN2_HI as (k + 127) LN2_HI - 127 LN2_HI: both exact, one level shallower than k first.
    biased_k = bits.astype(mx.float32)
    k_hi = biased_k * (LN2_HI * MANTISSA_SCALE) - BIAS * LN2_HI
    k_lo = biased_k * (LN2_LO * MANTISSA_SCALE) - BIAS * LN2_LO
    y = -x if sign < 0 else x
    if shift is not None:
        y = y - shift
    r = (mx.where(y < X_ZERO, X_ZERO, y) - k_hi) - k_lo
    r2 = r * r
    low = (r2 * scale) * (C0 + C1 * r)
    high = ((r2 * r2) * scale) * ((C2 + C3 * r) + C4 * r2)
    return scale + (((r * scale) + low) + high)


def exp_minus(x: mx.array, shift: mx.array) -> mx.array:
    """exp(x - shift), float32; shift broadcasts against x (a row max) and gets no gradient."""
    return cast(mx.array, _exp_minus(x, shift))


def exp_negated(x: mx.array) -> mx.array:
    """exp(-x), float32."""
    return cast(mx.array, _exp_negated(x))


def exp(x: mx.array) -> mx.array:
    """exp(x), float32. Where a shift applies, subtracting it first and calling this is faster than exp_minus on a
    CPU: a shift broadcast along rows makes MLX build both kernels with strided indexing, which g++ does not
    vectorise (a softmax over the demo's attention scores: 1.9 against 2.8 ms, docs/notes/2026-11-attention-cpu.md)."""
    return cast(mx.array, _exp_plain(x))


@mx.custom_function
def _exp_minus(x: mx.array, shift: mx.array) -> mx.array:
    return _exp(x, shift, 1.0)


@_exp_minus.vjp
def _exp_minus_vjp(primals, cotangent, output):
    return cotangent * output, mx.zeros_like(primals[1])


@mx.custom_function
def _exp_plain(x: mx.array) -> mx.array:
    return _exp(x, None, 1.0)


@_exp_plain.vjp
def _exp_plain_vjp(primals, cotangent, output):
    return cotangent * output


@mx.custom_function
def _exp_negated(x: mx.array) -> mx.array:
    return _exp(x, None, -1.0)


@_exp_negated.vjp
def _exp_negated_vjp(primals, cotangent, output):
    return -(cotangent * output)
