"""numerics.quotient_rn / div_rn (and div_exact on the CPU): the correctly rounded fp32 quotient, against numpy's
IEEE division.

On the CPU XLA divides correctly already, so the correction is tested by handing it quotients pushed 1 and 2 ulp
off on purpose (the GPU's division is within that), including quotients built to lie next to a midpoint between
two floats, the hard case (`_near_midpoints`). A GPU-only test checks `div_rn` itself where the correction runs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.numerics import div_exact, div_rn, quotient_rn

F32 = np.float32
N = 400_000


@pytest.fixture
def rng(test_seed):
    return np.random.default_rng(test_seed)


def _moved(q, ulps):
    """q pushed `ulps` floats up (positive) or down."""
    toward = F32(np.inf) if ulps > 0 else F32(-np.inf)
    for _ in range(abs(ulps)):
        q = np.nextafter(q, toward)
    return q


def _pairs(rng, divisor_bits):
    """Random signed a, b over wide exponent ranges; b with `divisor_bits` significant bits (24 = any fp32)."""
    a = (rng.standard_normal(N) * np.exp2(rng.integers(-40, 40, N))).astype(F32)
    b = rng.integers(2 ** (divisor_bits - 1), 2**divisor_bits, N) * np.exp2(rng.integers(-30, 10, N))
    b = (b * rng.choice([-1.0, 1.0], N)).astype(F32)
    return a, b


def _near_midpoints(rng, count=20_000):
    """Pairs a/b within 2^-24 half-ulps of a midpoint between two floats, where an inexact residual would pick
    the wrong side: with B odd (24 bits) and M = t * B^-1 mod 2^25 for a small odd t, M * B = A * 2^25 + t, so
    A / B = M / 2^25 - t / (2^25 B) and M / 2^25 (M odd, 25 bits) is a midpoint. Scaled by powers of two."""
    a, b = [], []
    while len(a) < count:
        big_b = int(rng.integers(2**23, 2**24)) | 1
        t = int(rng.choice([-3, -1, 1, 3]))
        m = t * pow(big_b, -1, 2**25) % 2**25
        if m >= 2**24:                                     # 25 significant bits: a midpoint
            a.append((m * big_b - t) // 2**25)
            b.append(big_b)
    scale = np.exp2(rng.integers(-30, 30, count))
    sign = rng.choice([-1.0, 1.0], count)
    b = np.array(b) * scale * np.exp2(rng.integers(-8, 8, count))
    return (np.array(a) * scale * sign).astype(F32), b.astype(F32)


def _assert_corrected(a, b):
    want = a / b                                           # numpy: IEEE, correctly rounded
    fn = jax.jit(quotient_rn)
    for ulps in (-2, -1, 0, 1, 2):
        got = np.asarray(fn(jnp.asarray(a), jnp.asarray(b), jnp.asarray(_moved(want, ulps))))
        wrong = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
        assert wrong.size == 0, (f"{wrong.size} quotients not corrected from {ulps:+d} ulp, e.g. "
                                 f"{a[wrong[:3]]} / {b[wrong[:3]]} -> {got[wrong[:3]]}, want {want[wrong[:3]]}")


@pytest.mark.parametrize("divisor_bits", [2, 4, 12, 24])
def test_quotient_rn_corrects_two_ulp(rng, divisor_bits):
    """Divisors with 2 (FP4's 6), 4 (e4m3 scales), 12 and 24 significant bits."""
    _assert_corrected(*_pairs(rng, divisor_bits))


def test_quotient_rn_near_midpoints(rng):
    a, b = _near_midpoints(rng)
    _assert_corrected(a, b)


def test_quotient_rn_leaves_out_of_range_values():
    """Zeros, infinities, NaN and quotients near underflow come back as they were given."""
    a = np.array([0.0, -0.0, np.inf, 1.0, np.nan, 2.0**-80, 1.0, 3.0], F32)
    b = np.array([3.0, 3.0, 3.0, 0.0, 3.0, 3.0, 2.0**70, np.inf], F32)
    q = np.array([0.0, -0.0, np.inf, np.inf, np.nan, 1e-24, 1e-21, 0.0], F32)
    got = np.asarray(jax.jit(quotient_rn)(a, b, q))
    np.testing.assert_array_equal(got.view(np.uint32), q.view(np.uint32))


CPU_ONLY = pytest.mark.skipif(jax.default_backend() != "cpu", reason="exact there only: the GPU's division is not IEEE")


@CPU_ONLY
def test_div_exact_and_div_rn_are_ieee_division_on_cpu(rng):
    a, b = _pairs(rng, 24)
    for fn in (div_exact, div_rn):
        got = np.asarray(jax.jit(fn)(a, b))
        np.testing.assert_array_equal(got.view(np.uint32), (a / b).view(np.uint32))


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the correction runs where division is not IEEE")
@pytest.mark.parametrize("divisor_bits", [2, 4, 24])
def test_div_rn_is_ieee_division_on_gpu(rng, divisor_bits):
    """On the GPU plain division is off by an ulp or two (reported); `div_rn` is not."""
    a, b = _pairs(rng, divisor_bits)
    want = a / b
    plain = np.asarray(jax.jit(lambda x, y: x / y)(a, b))
    print(f"plain GPU division: {np.mean(plain != want):.2%} of quotients not correctly rounded")
    got = np.asarray(jax.jit(div_rn)(a, b))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@CPU_ONLY
def test_div_rn_differentiates_like_division(rng):
    """Anything that differentiates through `div_rn` (training, through the quantizers' straight paths) gets the
    division's derivative, also where the correction is in the program (it traces every platform's branch). Bit for
    bit on the CPU; on the GPU the two programs' divisions are each an ulp or two off (41 of 43 numerics, quant and
    V4.1-row tests passed there; these two differed by ulps, at most 7.7e-6 relative:
    docs/benchmarks/h200-2026-12-03c/call4-pytest-gpu-final.log)."""
    a, b = (jnp.asarray(v) for v in _pairs(rng, 24))
    a, b = a[:1000], jnp.abs(b[:1000]) + 1.0
    loss = lambda f: lambda x, y: (f(x, y) * jnp.cos(x)).sum()  # noqa: E731
    got = jax.grad(loss(div_rn), argnums=(0, 1))(a, b)
    want = jax.grad(loss(lambda x, y: x / y), argnums=(0, 1))(a, b)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
