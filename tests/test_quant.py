"""Tests for dsjax.quant against independent numpy implementations.

The references below do their rounding in float64 with np.rint (ties to even) on the format's
quantum, and take ceil(log2) from np.frexp, so they share no code with dsjax.quant; ml_dtypes and
XLA's own conversions are checked against them too.  Random inputs are drawn from a fresh seed,
printed by the ``rng`` fixture; rerun a failure with DSJAX_TEST_SEED=<seed>.
"""

import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsjax import quant

F32 = np.float32
BF16 = ml_dtypes.bfloat16
SPEC_FP4_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


@pytest.fixture
def rng():
    env = os.environ.get("DSJAX_TEST_SEED")
    seed = int(env) if env else int(np.random.SeedSequence().entropy % 2**32)
    print(f"\n[test_quant] seed = {seed}  (rerun with DSJAX_TEST_SEED={seed})")
    return np.random.default_rng(seed)


# ----------------------------------------------------------------------------- independent references


def ref_round(x, mant_bits, min_exp):
    """Round to a float format with `mant_bits` stored mantissa bits and min normal exponent
    `min_exp` (no saturation: inputs are pre-clamped), ties to even, in float64."""
    x = np.asarray(x, np.float64)
    a = np.abs(x)
    e = np.maximum(np.floor(np.log2(np.maximum(a, 2.0**min_exp))), min_exp)
    q = np.exp2(e - mant_bits)
    return np.copysign(np.rint(a / q) * q, x)


def ref_e4m3(x):
    return ref_round(x, 3, -6).astype(F32)


def ref_e2m1(x):
    return ref_round(x, 1, 0).astype(F32)


def ref_ceil_pow2(q):
    m, e = np.frexp(np.asarray(q, np.float64))
    return np.ldexp(1.0, np.where(m == 0.5, e - 1, e)).astype(F32)


def ref_fp8_sim(x, block, pow2=True):
    x = np.asarray(x)
    xf = x.astype(F32).reshape(*x.shape[:-1], -1, block)
    amax = np.maximum(np.abs(xf).max(-1, keepdims=True), F32(1e-4))
    q = (amax * F32(1 / 448)).astype(F32)
    s = ref_ceil_pow2(q) if pow2 else q
    y = (ref_e4m3(np.clip(xf / s, -448, 448)) * s).astype(F32)
    return y.reshape(x.shape).astype(x.dtype)


def ref_fp4_sim(x, block, scale_format="ue8m0"):
    x = np.asarray(x)
    xf = x.astype(F32).reshape(*x.shape[:-1], -1, block)
    amax = np.abs(xf).max(-1, keepdims=True)
    if scale_format == "ue8m0":
        s = ref_ceil_pow2((np.maximum(amax, F32(6 * 2.0**-126)) * F32(1 / 6)).astype(F32))
    else:
        s = ref_e4m3(np.minimum(np.maximum(amax, F32(6 * 2.0**-9)) / F32(6), F32(448)))
    y = (ref_e2m1(np.clip(xf / s, -6, 6)) * s).astype(F32)
    return y.reshape(x.shape).astype(x.dtype)


def bits(a):
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32, 1: np.uint8}[a.dtype.itemsize])


def assert_bits_equal(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    bad = bits(got) != bits(want)
    if bad.any():
        i = np.argwhere(bad)[:5]
        raise AssertionError(f"{bad.sum()} mismatches, e.g. at {i.tolist()}: got {got[bad][:5]} want {want[bad][:5]}")


def sylvester(n):
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def all_finite_values(dtype, limit):
    """Every finite value of a 1-2 byte float dtype with |v| <= limit, as fp32."""
    raw = np.arange(2 ** (8 * np.dtype(dtype).itemsize), dtype={1: np.uint8, 2: np.uint16}[np.dtype(dtype).itemsize])
    v = raw.view(dtype).astype(F32)
    return v[np.isfinite(v) & (np.abs(v) <= limit)]


# ----------------------------------------------------------------------------- random inputs


def random_blocks(rng, shape, block, lo=-40, hi=40):
    """Normal values with a log-uniform magnitude per block, some exact zeros and negative zeros."""
    x = rng.standard_normal(shape)
    scale = np.exp2(rng.uniform(lo, hi, size=shape[:-1] + (shape[-1] // block, 1)))
    x = (x.reshape(*shape[:-1], -1, block) * scale).reshape(shape)
    x[rng.random(shape) < 0.03] = 0.0
    x[rng.random(shape) < 0.03] = -0.0
    return x.astype(F32)


def e4m3_midpoints():
    v = np.unique(np.abs(all_finite_values(ml_dtypes.float8_e4m3fn, 448)))
    return ((v[:-1].astype(np.float64) + v[1:]) / 2).astype(F32)  # exact in fp32


E2M1_TIES = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], F32)


def tie_blocks(rng, nblocks, block, top, ties, scales):
    """Blocks whose amax is top*scale (so the block scale is `scale`) and whose other elements are
    exact ties of the grid times that scale, with random signs."""
    s = rng.choice(scales, size=(nblocks, 1)).astype(F32)
    v = rng.choice(ties, size=(nblocks, block)).astype(F32)
    v[:, rng.integers(block)] = top
    v *= rng.choice([-1.0, 1.0], size=v.shape).astype(F32)
    return (v * s).astype(F32)


# ----------------------------------------------------------------------------- format primitives


def test_xla_and_ml_dtypes_casts_are_rne(rng):
    """Finding: XLA's f32->float8_e4m3fn and f32->float4_e2m1fn conversions and ml_dtypes'
    are round-to-nearest-even (checked on every bf16 value in range, every tie, random fp32)."""
    for dt, lim, ref, ties in ((ml_dtypes.float8_e4m3fn, 448, ref_e4m3, e4m3_midpoints()),
                               (ml_dtypes.float4_e2m1fn, 6, ref_e2m1, E2M1_TIES)):
        x = np.concatenate([all_finite_values(BF16, lim), ties, -ties,
                            rng.uniform(-lim, lim, 20000).astype(F32),
                            (rng.uniform(-1, 1, 5000) * 2.0 ** rng.integers(-40, 0, 5000)).astype(F32)])
        want = ref(x)
        assert_bits_equal(x.astype(dt).astype(F32), want)
        # The codes leave the jit and widen on the host: inside one jit XLA's GPU pipeline removes the
        # f32 -> e4m3 -> f32 chain (quant.e4m3_values), which would test nothing there.
        got = jax.jit(lambda a, dt=dt: a.astype(dt))(jnp.asarray(x))
        assert_bits_equal(np.asarray(got).astype(F32), want)
        if dt is ml_dtypes.float4_e2m1fn:
            assert_bits_equal(np.asarray(jax.jit(quant.e2m1_round)(jnp.asarray(x))), want)
            assert_bits_equal(quant.e2m1_round(x), want)


def test_e2m1_ties_from_spec():
    x = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, 0.0, -0.0, 6.0, 5.0001], F32)
    want = np.array([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -4.0, 0.0, -0.0, 6.0, 6.0], F32)
    assert_bits_equal(np.asarray(quant.e2m1_round(jnp.asarray(x))), want)


def test_ue8m0_ceil_scale(rng):
    p = np.exp2(np.arange(-126, 128, dtype=np.float64)).astype(F32)
    ulp_up = np.nextafter(p, np.inf, dtype=F32)
    ulp_dn = np.nextafter(p[1:], 0, dtype=F32)
    rand = np.exp2(rng.uniform(-125, 126, 50000)).astype(F32)
    v = np.concatenate([p, ulp_up[:-1], ulp_dn, rand, np.array([1e-4 / 448, 1 / 6, 448.0, 6.0], F32)])
    want = ref_ceil_pow2(v)
    assert_bits_equal(np.asarray(jax.jit(quant.ue8m0_ceil_scale)(jnp.asarray(v))), want)
    assert_bits_equal(quant.ue8m0_ceil_scale(v), want)


def test_e8m0_bytes():
    b = np.arange(256, dtype=np.uint8)
    got = quant.e8m0_to_f32(b)
    want = np.ldexp(1.0, b[:255].astype(np.int64) - 127).astype(F32)
    assert_bits_equal(got[:255], want[:255])
    assert np.isnan(got[255])
    assert_bits_equal(np.asarray(quant.e8m0_to_f32(jnp.asarray(b)))[:255], want[:255])
    assert_bits_equal(quant.e8m0_to_f32(b.view(ml_dtypes.float8_e8m0fnu))[:255], want[:255])
    assert_bits_equal(quant.f32_to_e8m0_exact(want[:255]), b[:255])
    assert_bits_equal(np.asarray(quant.f32_to_e8m0_exact(jnp.asarray(want[:255]))), b[:255])
    assert quant.f32_to_e8m0_exact(np.array([np.nan], F32))[0] == 255
    for bad in (3.0, 0.0, -1.0, np.inf, 1.5):
        with pytest.raises(ValueError):
            quant.f32_to_e8m0_exact(np.array([bad], F32))


# ----------------------------------------------------------------------------- fake quantization


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_fp8_sim_random(rng, dtype):
    x = random_blocks(rng, (3, 5, 256), 32).astype(dtype)
    x[0, 0, :32] = 0.0                                         # all-zero block -> floor
    x[0, 1, :32] = (rng.standard_normal(32) * 1e-6).astype(dtype)  # amax below the 1e-4 floor
    x[0, 2, :32] = (rng.standard_normal(32) * 1e30).astype(dtype)  # large
    x[0, 3, 5] = -0.0
    for block in (32, 128):
        for pow2 in (True, False):
            f = jax.jit(quant.fp8_e4m3_sim, static_argnums=1, static_argnames="pow2")
            got = np.asarray(f(jnp.asarray(x), block, pow2=pow2))
            assert got.dtype == np.dtype(dtype)
            assert_bits_equal(got, ref_fp8_sim(x, block, pow2))


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_fp8_codes_times_scales_are_the_sim(rng, dtype):
    """`fp8_e4m3_codes` (what FP8 tensor cores take) times its power-of-two scales is `fp8_e4m3_sim`, bit for bit,
    floors and huge blocks included."""
    x = random_blocks(rng, (3, 5, 256), 32).astype(dtype)
    x[0, 0, :32] = 0.0
    x[0, 2, :32] = (rng.standard_normal(32) * 1e30).astype(dtype)
    for block in (32, 128):
        codes, scales = quant.fp8_e4m3_codes(jnp.asarray(x), block)
        assert codes.dtype == jnp.float8_e4m3fn and scales.shape == x.shape[:-1] + (256 // block,)
        s = np.log2(np.asarray(scales))
        assert np.array_equal(s, np.round(s)), "scales are powers of two"
        back = (np.asarray(codes, np.float32).reshape(3, 5, -1, block) * np.asarray(scales)[..., None])
        assert_bits_equal(back.reshape(x.shape).astype(dtype), np.asarray(quant.fp8_e4m3_sim(jnp.asarray(x), block)))


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_fp8_row_codes_are_the_reference_codes(rng, dtype):
    """`fp8_e4m3_row_codes` (the power-of-two FP8 quantizer, one scale block a row, a reciprocal multiply; XLA's
    path and the MoE kernels use it) gives the numpy reference's codes (ml_dtypes' RNE cast of clamp(x / s)) and
    scales bit for bit: e4m3 midpoints (ties), zero rows, the floor, huge rows."""
    mids = e4m3_midpoints()
    x = np.concatenate([random_blocks(rng, (48, 128), 128),
                        tie_blocks(rng, 16, 128, 448.0, mids[mids < 448], np.exp2(np.arange(-20, 20.0)))])
    x[0] = 0.0
    x[1, :] = np.float32(3e-5)
    x[2] = (rng.standard_normal(128) * 1e30).astype(F32)
    x = x.astype(dtype)
    codes, scales = jax.jit(quant.fp8_e4m3_row_codes)(jnp.asarray(x).astype(jnp.float32))
    xf = x.astype(F32)
    want_scales = ref_ceil_pow2((np.maximum(np.abs(xf).max(-1), F32(1e-4)) * F32(1 / 448)).astype(F32))
    want_codes = np.clip(xf / want_scales[:, None], -448, 448).astype(ml_dtypes.float8_e4m3fn)
    assert codes.dtype == jnp.float8_e4m3fn and scales.shape == (64,)
    assert_bits_equal(np.asarray(codes), want_codes)
    assert_bits_equal(np.asarray(scales), want_scales)


def test_fp8_sim_ties_and_edges(rng):
    mids = e4m3_midpoints()
    mids = mids[mids < 448]
    x = tie_blocks(rng, 64, 64, 448.0, mids, np.exp2(np.arange(-20, 20, dtype=np.float64)))
    x[0] = 0.0
    x[1] = -0.0
    x[2, :] = np.float32(3e-5)
    x[3, :] = np.linspace(-448, 448, 64, dtype=F32) * F32(2.0**-22)  # tiny, below the floor
    y = np.asarray(quant.fp8_e4m3_sim(jnp.asarray(x), 64))
    assert_bits_equal(y, ref_fp8_sim(x, 64))
    assert (bits(y[1]) == 0x80000000).all()  # negative zeros survive
    # the tie blocks really exercise ties: dividing by the known scale gives midpoints
    assert np.isin(np.abs(x[4:] / (np.abs(x[4:]).max(-1, keepdims=True) / 448)), np.append(mids, 448)).all()
    # bf16 ties too
    xb = x.astype(BF16)
    assert_bits_equal(np.asarray(quant.fp8_e4m3_sim(jnp.asarray(xb), 64)), ref_fp8_sim(xb, 64))


@pytest.mark.parametrize("fmt", ["ue8m0", "e4m3"])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_fp4_sim_random(rng, fmt, dtype):
    lo = -40 if fmt == "ue8m0" else -12
    x = random_blocks(rng, (4, 3, 128), 16, lo=lo, hi=40).astype(dtype)
    x[0, 0, :32] = 0.0
    x[0, 1, :32] = (rng.uniform(-1, 1, 32) * 1e-4).astype(dtype)  # below the e4m3 floor 6*2^-9
    x[0, 2, :32] = (rng.uniform(-1, 1, 32) * 1e4).astype(dtype)   # e4m3 quotient saturates at 448
    # ue8m0 floor 6*2^-126: all values normal, quotients >= 1 so nothing lands in fp32 subnormals
    x[1, 0, :32] = (np.exp2(-126.0) * rng.uniform(1.0, 5.9, 32) * rng.choice([-1, 1], 32)).astype(dtype)
    x[1, 1, 7] = -0.0
    for block in (16, 32):
        f = jax.jit(quant.fp4_e2m1_sim, static_argnums=1, static_argnames="scale_format")
        got = np.asarray(f(jnp.asarray(x), block, scale_format=fmt))
        assert got.dtype == np.dtype(dtype)
        assert_bits_equal(got, ref_fp4_sim(x, block, fmt))


def test_fp4_sim_ties(rng):
    ties = np.concatenate([E2M1_TIES, [0.0, 0.5, 1.0, 3.0, 6.0]]).astype(F32)
    x = tie_blocks(rng, 64, 32, 6.0, ties, np.exp2(np.arange(-100, 100, dtype=np.float64)))
    assert_bits_equal(np.asarray(quant.fp4_e2m1_sim(jnp.asarray(x), 32)), ref_fp4_sim(x, 32))
    # e4m3 scales: amax = 6*t for an e4m3 value t gives s = t exactly; also amax/6 on e4m3 ties
    e4 = np.unique(np.abs(all_finite_values(ml_dtypes.float8_e4m3fn, 448)))
    e4 = e4[e4 >= 2.0**-9]
    xe = tie_blocks(rng, 64, 16, 6.0, ties, e4)
    mids = e4m3_midpoints()
    xe[:8, 0] = 6 * rng.choice(mids[mids >= 2.0**-9], 8)  # scale quotient exactly on an e4m3 tie
    xe[:8, 1:] = 0.0
    got = np.asarray(quant.fp4_e2m1_sim(jnp.asarray(xe), 16, scale_format="e4m3"))
    assert_bits_equal(got, ref_fp4_sim(xe, 16, "e4m3"))
    # the spec's worked tie examples, with scale 1 (amax 6)
    t = np.array([[6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]], F32)
    assert_bits_equal(np.asarray(quant.fp4_e2m1_sim(jnp.asarray(t), 8)),
                      np.array([[6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]], F32))


def test_fp8_sim_nonpow2_near_ties(rng):
    """pow2=False: s = amax*fp32(1/448) is not a power of two, so x/s must be the IEEE quotient
    (XLA would otherwise turn it into x * (1/s)); x = mid*s puts x/s on or next to e4m3 ties."""
    mids = e4m3_midpoints()
    mids = mids[(mids < 448) & (mids > 2.0**-6)]
    amax = np.exp2(rng.uniform(-10, 10, (256, 1))).astype(F32)
    s = (amax * F32(1 / 448)).astype(F32)
    x = (rng.choice(mids, (256, 32)) * s * rng.choice([-1.0, 1.0], (256, 32))).astype(F32)
    x[:, 0] = amax[:, 0]
    got = np.asarray(quant.fp8_e4m3_sim(jnp.asarray(x), 32, pow2=False))
    assert_bits_equal(got, ref_fp8_sim(x, 32, pow2=False))


def test_fp4_e4m3_scale_is_a_true_division():
    """amax/6 (not amax*fp32(1/6)): these 15 amax values are the only fp32 in [6*2^-9, 2688]
    where the two differ after rounding to e4m3 (found by exhaustive scan)."""
    amax = (np.uint32(0x3DE3FFFF) + (np.arange(15, dtype=np.uint32) << 23)).view(F32)
    x = np.zeros((15, 16), F32)
    x[:, 0] = amax
    x[:, 1] = amax * F32(0.5)
    got = np.asarray(quant.fp4_e2m1_sim(jnp.asarray(x), 16, scale_format="e4m3"))
    assert_bits_equal(got, ref_fp4_sim(x, 16, "e4m3"))
    s_div = ref_e4m3(amax / F32(6))
    assert (ref_e4m3(amax * F32(1 / 6)) != s_div).all()
    # amax/s > 6 with the rounded-down scale: the max element clamps to 6*s
    assert_bits_equal(got[:, 0], (6 * s_div).astype(F32))


def test_sim_shapes_and_errors():
    x = jnp.ones((2, 3, 4, 64), jnp.bfloat16)
    assert quant.fp8_e4m3_sim(x, 32).shape == x.shape
    assert quant.fp4_e2m1_sim(x, 16, scale_format="e4m3").dtype == jnp.bfloat16
    with pytest.raises(ValueError):
        quant.fp8_e4m3_sim(jnp.ones((4, 48)), 32)
    with pytest.raises(ValueError):
        quant.fp4_e2m1_sim(x, 32, scale_format="e8m0")


# ----------------------------------------------------------------------------- hadamard


def test_hadamard(rng):
    for n in (1, 2, 8, 128):
        h = sylvester(n)
        assert_bits_equal(quant.hadamard_matrix(n), h.astype(F32))
        got = np.asarray(quant.hadamard(jnp.eye(n, dtype=jnp.float32)), np.float64)
        np.testing.assert_allclose(got, h / np.sqrt(n), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(got @ got, np.eye(n), atol=1e-5)  # orthogonal and symmetric
    x = rng.standard_normal((3, 5, 128)).astype(F32)
    y = np.asarray(jax.jit(quant.hadamard)(jnp.asarray(x)))
    np.testing.assert_allclose(y, x.astype(np.float64) @ sylvester(128) / np.sqrt(128), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(quant.hadamard(jnp.asarray(y))), x, rtol=1e-5, atol=1e-5)
    xb = jnp.asarray(x).astype(jnp.bfloat16)
    yb = quant.hadamard(xb)
    assert yb.dtype == jnp.bfloat16
    want = (np.asarray(xb.astype(jnp.float32), np.float64) @ sylvester(128) / np.sqrt(128)).astype(F32)
    np.testing.assert_allclose(np.asarray(yb.astype(jnp.float32)), want, rtol=2**-8, atol=1e-6)
    with pytest.raises(ValueError):
        quant.hadamard(jnp.ones((4, 96)))


# ----------------------------------------------------------------------------- FP8 checkpoint codec


def fp8_sim_2d(w, bo, bi):
    """fp8_e4m3_sim with each Bo x Bi block of a [..., out, in] matrix laid out as one row."""
    *lead, out, inn = w.shape
    no, ni = -(-out // bo), -(-inn // bi)
    wp = np.pad(w, [(0, 0)] * len(lead) + [(0, no * bo - out), (0, ni * bi - inn)])
    rows = wp.reshape(*lead, no, bo, ni, bi).swapaxes(-3, -2).reshape(*lead, no * ni, bo * bi)
    y = np.asarray(quant.fp8_e4m3_sim(jnp.asarray(rows), bo * bi))
    y = y.reshape(*lead, no, ni, bo, bi).swapaxes(-3, -2).reshape(*lead, no * bo, ni * bi)
    return y[..., :out, :inn]


@pytest.mark.parametrize("shape,block", [((200, 300), 128), ((2, 70, 90), 32), ((64, 64), (32, 16))])
def test_fp8_codec_matches_sim(rng, shape, block):
    bo, bi = (block, block) if isinstance(block, int) else block
    w = (rng.standard_normal(shape) * np.exp2(rng.uniform(-12, 4, shape[:-2] + (1, 1)))).astype(F32)
    w[..., :bo, :bi] = 0.0  # all-zero block
    for xp_in in (np.asarray, jnp.asarray):
        q, s = quant.quantize_fp8_blocks(xp_in(w), block)
        q, s = np.asarray(q), np.asarray(s)
        assert q.dtype == np.dtype(ml_dtypes.float8_e4m3fn) and s.dtype == np.uint8
        assert s.shape == shape[:-2] + (-(-shape[-2] // bo), -(-shape[-1] // bi))
        assert s[(0,) * (len(shape) - 2) + (0, 0)] == 105  # 2^ceil(log2(1e-4/448)) = 2^-22
        deq = quant.dequantize_fp8_blocks(q, s, block)
        assert_bits_equal(deq, fp8_sim_2d(w, bo, bi))
        # the numpy reference formula from the spec, element by element
        i, j = np.indices(shape[-2:])
        want = q.astype(F32) * np.exp2(s[..., i // bo, j // bi].astype(np.float64) - 127).astype(F32)
        assert_bits_equal(deq, want)


def random_fp8_checkpoint(rng, shape, bo, bi):
    """Valid e4m3 bytes (no NaN) and scales for which quantize(dequantize) must be the identity:
    each block has an element with |v| > 224 so that its requantized exponent is the same."""
    *lead, out, inn = shape
    q = rng.integers(0, 0x7F, shape, dtype=np.uint8) | (rng.integers(0, 2, shape, dtype=np.uint8) << 7)
    no, ni = -(-out // bo), -(-inn // bi)
    q[..., ::bo, ::bi] = rng.integers(0x77, 0x7F, tuple(lead) + (no, ni), dtype=np.uint8) | (
        rng.integers(0, 2, tuple(lead) + (no, ni), dtype=np.uint8) << 7)
    s = rng.integers(110, 200, tuple(lead) + (no, ni), dtype=np.uint8)
    return q.view(ml_dtypes.float8_e4m3fn), s


@pytest.mark.parametrize("shape,block", [((200, 300), 128), ((3, 40, 72), 32)])
def test_fp8_codec_requantize_exact(rng, shape, block):
    q, s = random_fp8_checkpoint(rng, shape, block, block)
    w = quant.dequantize_fp8_blocks_np(q, s, block)
    q2, s2 = quant.quantize_fp8_blocks(w, block)
    assert_bits_equal(q2, q)
    assert_bits_equal(s2, s)
    q3, s3 = quant.quantize_fp8_blocks(jnp.asarray(w), block)
    assert_bits_equal(np.asarray(q3), q)
    assert_bits_equal(np.asarray(s3), s)
    # jnp dequantize (jitted; e4m3 or raw bytes) equals numpy dequantize
    f = jax.jit(quant.dequantize_fp8_blocks, static_argnums=2)
    assert_bits_equal(np.asarray(f(jnp.asarray(q), jnp.asarray(s), block)), w)
    assert_bits_equal(np.asarray(f(jnp.asarray(q.view(np.uint8)), jnp.asarray(s), block)), w)
    assert_bits_equal(quant.dequantize_fp8_blocks(q.view(np.uint8), s, [block, block]), w)


def test_fp8_codec_nan_scale_and_shape():
    q = np.zeros((64, 64), ml_dtypes.float8_e4m3fn)
    s = np.full((2, 2), 127, np.uint8)
    s[1, 0] = 255
    with pytest.raises(ValueError, match="255"):
        quant.dequantize_fp8_blocks_np(q, s, 32)
    with pytest.raises(ValueError, match="255"):
        quant.dequantize_fp8_blocks(q, s, 32)
    out = np.asarray(quant.dequantize_fp8_blocks(jnp.asarray(q), jnp.asarray(s), 32))
    assert np.isnan(out[32:, :32]).all() and (out[:32] == 0).all()
    with pytest.raises(ValueError, match="expected"):
        quant.dequantize_fp8_blocks_np(q, s[:1], 32)


# ----------------------------------------------------------------------------- FP4 checkpoint codec


def test_fp4_nibble_order_against_spec_table():
    b = np.arange(256, dtype=np.uint8).reshape(1, 256)
    s = np.full((1, 512 // 32), 127, np.uint8)
    want = np.stack([np.array(SPEC_FP4_TABLE, F32)[b & 15], np.array(SPEC_FP4_TABLE, F32)[b >> 4]], -1).reshape(1, 512)
    assert_bits_equal(quant.dequantize_fp4_packed(b, s), want)
    assert_bits_equal(quant.dequantize_fp4_packed(b.view(np.int8), s), want)
    assert_bits_equal(np.asarray(jax.jit(quant.dequantize_fp4_packed)(jnp.asarray(b), jnp.asarray(s))), want)
    assert_bits_equal(quant.FP4_CODE_TABLE, np.array(SPEC_FP4_TABLE, F32))
    # element 0 = 0.5 (code 1) in the low nibble, element 1 = 6 (code 7) in the high nibble
    assert quant.pack_fp4_codes(np.array([1, 7], np.uint8))[0] == 0x71
    w = np.zeros((1, 32), F32)
    w[0, :4] = [0.5, 6.0, -0.0, -1.5]
    p, sc = quant.quantize_fp4_packed(w)
    assert p[0, 0] == 0x71 and p[0, 1] == 0xB8 and sc[0, 0] == 127
    assert_bits_equal(quant.unpack_fp4_codes(p)[0, :4], np.array([1, 7, 8, 11], np.uint8))


@pytest.mark.parametrize("shape", [(48, 256), (2, 8, 64)])
def test_fp4_codec_matches_sim(rng, shape):
    w = random_blocks(rng, shape, 32, lo=-30, hi=30)
    w[..., 0, :32] = 0.0
    for xp_in in (np.asarray, jnp.asarray):
        p, s = quant.quantize_fp4_packed(xp_in(w), 32)
        p, s = np.asarray(p), np.asarray(s)
        assert p.dtype == np.uint8 and p.shape == shape[:-1] + (shape[-1] // 2,)
        assert s.dtype == np.uint8 and s.shape == shape[:-1] + (shape[-1] // 32,)
        assert (s[..., 0, 0] == 1).all()  # all-zero block: floor 6*2^-126 -> 2^-126
        assert_bits_equal(quant.dequantize_fp4_packed(p, s, 32), np.asarray(quant.fp4_e2m1_sim(jnp.asarray(w), 32)))
        assert_bits_equal(quant.dequantize_fp4_packed(p, s, 32), ref_fp4_sim(w, 32))


def test_fp4_codec_requantize_exact(rng):
    shape = (3, 40, 256)
    codes = rng.integers(0, 16, shape, dtype=np.uint8)
    # each block needs |value| >= 4 (codes 6, 7, 14, 15) so requantizing picks the same exponent
    codes[..., ::32] = rng.choice(np.array([6, 7, 14, 15], np.uint8), shape[:-1] + (shape[-1] // 32,))
    p = quant.pack_fp4_codes(codes)
    s = rng.integers(60, 200, shape[:-1] + (shape[-1] // 32,), dtype=np.uint8)
    w = quant.dequantize_fp4_packed_np(p, s, 32)
    for xp_in in (np.asarray, jnp.asarray):
        p2, s2 = quant.quantize_fp4_packed(xp_in(w), 32)
        assert_bits_equal(np.asarray(p2), p)
        assert_bits_equal(np.asarray(s2), s)
    assert_bits_equal(quant.unpack_fp4_codes(p), codes)
    f = jax.jit(quant.dequantize_fp4_packed, static_argnums=2)
    assert_bits_equal(np.asarray(f(jnp.asarray(p), jnp.asarray(s), 32)), w)
    assert_bits_equal(np.asarray(f(jnp.asarray(p.view(np.int8)), jnp.asarray(s), 32)), w)
    bf = np.asarray(quant.dequantize_fp4_packed(jnp.asarray(p), jnp.asarray(s), 32, dtype=jnp.bfloat16))
    assert_bits_equal(bf, w.astype(BF16))


def test_fp4_codec_nan_scale():
    p = np.zeros((2, 32), np.uint8)
    s = np.array([[127, 255], [127, 127]], np.uint8)
    with pytest.raises(ValueError, match="255"):
        quant.dequantize_fp4_packed_np(p, s, 32)
    out = np.asarray(quant.dequantize_fp4_packed(jnp.asarray(p), jnp.asarray(s), 32))
    assert np.isnan(out[0, 32:]).all() and not np.isnan(out[1]).any()
    with pytest.raises(ValueError, match="expected"):
        quant.dequantize_fp4_packed_np(p, s[:, :1], 32)


def test_e4m3_values_decode_every_code():
    """`quant.e4m3_values` (the FP8 rounding's way back to fp32, by integer ops) equals the e4m3 cast for all 254
    non-NaN codes, signed zeros and subnormals included."""
    codes = np.arange(256, dtype=np.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]
    want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = np.asarray(quant.e4m3_values(jnp.asarray(codes.view(ml_dtypes.float8_e4m3fn))))
    assert_bits_equal(got, want)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the conversion-chain removal is XLA's GPU pipeline's")
def test_fp8_sim_rounds_on_gpu(rng):
    """Compiled for the GPU inside one jit, the FP8 fake quantizer still rounds (XLA there removes f32 -> e4m3 ->
    f32 convert chains; `e4m3_values` keeps the rounding): the same bits as the numpy reference."""
    x = random_blocks(rng, (4, 512), 32).astype(F32)
    got = np.asarray(jax.jit(lambda v: quant.fp8_e4m3_sim(v * 1.0, 128))(jnp.asarray(x)))
    assert_bits_equal(got, ref_fp8_sim(x, 128, True))
