"""Low-precision number formats of DeepSeek-V4 / V4.1: fake quantization and checkpoint codecs.

Two kinds of function live here.

* **Fake quantizers** (``fp8_e4m3_sim``, ``fp4_e2m1_sim``) reproduce the reference's in-place
  ``act_quant`` / ``fp4_act_quant`` kernels (``inplace=True``): each block of contiguous elements
  along the last dim is scaled, rounded to FP8 e4m3 / FP4 e2m1 and scaled back, and the value
  leaves in the input's dtype.  The reference caches (window KV, compressed KV, index keys)
  hold exactly these values, so bit parity with the reference needs them bit for bit.
  They are pure ``jnp``, jit-able, take any number of leading dims and compute in fp32.
* **Checkpoint codecs** (``quantize_*`` / ``dequantize_*``) for the stored FP8 [out, in] weights
  with E8M0 [ceil(out/B), ceil(in/B)] block scales and the packed FP4 experts.  They accept
  numpy arrays (host-side loader; numpy in, numpy out) or jax arrays / tracers (device; jit-able),
  the jax path is taken when any array argument is a jax array or tracer.

Arithmetic follows the official ``inference/kernel.py`` (``act_quant_kernel``,
``fp4_quant_kernel``, ``fast_log2_ceil``, ``fast_pow2``, ``fast_round_scale``):

* The FP8 quotient is ``amax * fp32(1/448)`` (a product, as in the kernel, not a division; for
  the non-power-of-two scale this differs from ``amax / 448`` in the last bit for ~1/3 of inputs).
  The ue8m0 FP4 quotient is ``amax * fp32(1/6)``.  For the power-of-two ("ue8m0") scales product
  and quotient give the same ceil(log2) for every fp32 amax (checked exhaustively).
* The V4.1 e4m3-scaled FP4 (main compressed KV) follows the V4.1 kernel as independent ports
  describe it: ``s = e4m3_rn_satfinite(max(amax, 6*2^-9) / 6)`` (a true division; it differs from
  ``amax * fp32(1/6)`` after e4m3 rounding for 15 fp32 amax values only).
* Rounding to e4m3 and e2m1 is round-to-nearest-even after clamping to the format's max.

XLA notes.  XLA's algebraic simplifier turns ``x / broadcast(s)`` and ``x / const`` into
``x * (1/s)``; that is exact for power-of-two s but not otherwise, so the non-power-of-two divisions
(FP8 with ``pow2=False``, the e4m3-scaled FP4) go through ``_div_rn``.  XLA CPU's
f32 -> float8_e4m3fn / float4_e2m1fn conversions are round-to-nearest-even (same bits as ml_dtypes
for every fp32 in range).  XLA CPU flushes subnormal fp32 *arithmetic* results to zero (FTZ).  That
only matters where a product lands below 2^-126, i.e. e2m1 0.5 times the smallest ue8m0 scale
2^-126, or an E8M0 scale byte 0 (2^-127); the numpy codec paths keep those subnormals.
"""

from __future__ import annotations

from functools import partial
from typing import Literal

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from dsjax.numerics import div_rn as _div_rn, round_to

__all__ = [
    "FP8_MAX", "FP4_MAX", "FP4_CODE_TABLE",
    "ue8m0_ceil_scale", "e2m1_round", "fp8_e4m3_sim", "fp8_e4m3_codes", "fp4_e2m1_sim", "hadamard", "hadamard_matrix",
    "e8m0_to_f32", "f32_to_e8m0_exact",
    "quantize_fp8_blocks", "dequantize_fp8_blocks", "dequantize_fp8_blocks_np",
    "quantize_fp4_packed", "dequantize_fp4_packed", "dequantize_fp4_packed_np",
    "pack_fp4_codes", "unpack_fp4_codes",
]

FP8_MAX = 448.0
FP4_MAX = 6.0
# The kernels multiply by these fp32 reciprocals (a Python float folded into an fp32 expression).
_FP8_MAX_INV = np.float32(1.0 / 448.0)
_FP4_MAX_INV = np.float32(1.0 / 6.0)
# amax floors: act_quant_kernel (1e-4), fp4_quant_kernel (6*2^-126: scale >= 2^-126, a normal fp32),
# V4.1 e4m3-scaled FP4 (6*2^-9: the scale is at least e4m3's smallest subnormal, so an all-zero block
# still gets a nonzero, invertible scale).
_FP8_AMAX_FLOOR = np.float32(1e-4)
_FP4_UE8M0_AMAX_FLOOR = np.float32(6 * 2.0**-126)
_FP4_E4M3_AMAX_FLOOR = np.float32(6 * 2.0**-9)

# Checkpoint FP4 code -> value (convert.py's FP4_TABLE): bit 3 is the sign, bits 0-2 index the grid.
FP4_CODE_TABLE = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)

_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
_F32 = np.float32


# ----------------------------------------------------------------------------- helpers


def _is_jax(*arrays) -> bool:
    """True if any argument is a jax array or tracer: pick the jnp code path."""
    return any(isinstance(a, jax.Array) for a in arrays)


def _xp(*arrays):
    return jnp if _is_jax(*arrays) else np


def _bitcast(x, dtype, xp):
    """Reinterpret the bits of ``x`` as ``dtype`` (same itemsize)."""
    if xp is np:
        return np.asarray(x).view(dtype)
    return jax.lax.bitcast_convert_type(x, dtype)


def _as_u8(x, xp):
    """Raw bytes of a uint8 / int8 / float8_e8m0fnu / float8_e4m3fn array as uint8."""
    x = xp.asarray(x)
    if x.dtype == np.uint8:
        return x
    if x.dtype.itemsize != 1:
        raise TypeError(f"expected a 1-byte dtype, got {x.dtype}")
    return _bitcast(x, np.uint8, xp)


def _block2(block) -> tuple[int, int]:
    if isinstance(block, (int, np.integer)):
        return int(block), int(block)
    bo, bi = block
    return int(bo), int(bi)


def _ceil_log2_bits(v, xp):
    """``fast_log2_ceil``: unbiased exponent, +1 if any mantissa bit is set (int32). v > 0, normal."""
    bits = _bitcast(xp.asarray(v).astype(_F32), np.uint32, xp)
    exp = ((bits >> 23) & 0xFF).astype(np.int32)
    man = bits & np.uint32(0x7FFFFF)
    return exp - 127 + (man != 0).astype(np.int32)


def _pow2_bits(e, xp):
    """``fast_pow2``: 2^e for integer e in [-126, 127] by writing the fp32 exponent field."""
    return _bitcast((e.astype(np.int32) + 127) << 23, _F32, xp)


# ----------------------------------------------------------------------------- scalar-format primitives


def ue8m0_ceil_scale(amax_over_qmax):
    """2^ceil(log2(v)) from the fp32 bits, as the reference's ``fast_round_scale`` computes it.

    Why bits and not log2/ceil: ``fast_log2_ceil`` takes the exponent field and adds one when any
    mantissa bit is set; that is exact for every normal fp32, while ``exp2(ceil(log2(v)))`` can be
    off by one near powers of two.  Valid for normal positive v (the amax floors guarantee it).
    Works on numpy and jax arrays.
    """
    xp = _xp(amax_over_qmax)
    return _pow2_bits(_ceil_log2_bits(amax_over_qmax, xp), xp)


def _e2m1_index(a, xp):
    """Grid index 0..7 of round-to-nearest-even(|v|) on {0,.5,1,1.5,2,3,4,6}, for a = |v| <= 6.

    Each grid step is a comparison against the midpoint; ``>`` at midpoints whose lower neighbour
    has an even code (0.25, 1.25, 2.5, 5) and ``>=`` where the upper one has (0.75, 1.75, 3.5), so
    exact ties go to the even code.
    """
    i = lambda c: c.astype(np.int32)
    return (i(a > 0.25) + i(a >= 0.75) + i(a > 1.25) + i(a >= 1.75)
            + i(a > 2.5) + i(a >= 3.5) + i(a > 5.0))


def e2m1_round(v):
    """Round fp32 ``v`` (already clamped to [-6, 6]) to FP4 e2m1, ties to the even code, sign kept.

    Why comparisons and not ``astype(jnp.float4_e2m1fn)``: XLA CPU's conversion gives identical
    bits (checked exhaustively over all fp32 in [-6, 6]), but a compare/select chain lowers on every
    backend, while float4 conversions are not guaranteed to.  NaN propagates.
    """
    xp = _xp(v)
    v = xp.asarray(v).astype(_F32)
    a = xp.abs(v)
    mag = (0.5 * ((a > 0.25).astype(_F32) + (a >= 0.75) + (a > 1.25) + (a >= 1.75))
           + (a > 2.5).astype(_F32) + (a >= 3.5) + 2.0 * (a > 5.0)).astype(_F32)
    return xp.where(xp.isnan(v), v, xp.copysign(mag, v))


# ----------------------------------------------------------------------------- fake quantization


def _blocks(x, block: int):
    """fp32 view [..., n/block, block] of the last dim (the reference asserts n % block == 0)."""
    n = x.shape[-1]
    if block <= 0 or n % block:
        raise ValueError(f"last dim {n} is not a multiple of the quantization block {block}")
    return x.astype(jnp.float32).reshape(*x.shape[:-1], n // block, block)


@partial(jax.jit, static_argnames=("block", "pow2"))
def fp8_e4m3_sim(x, block: int, *, pow2: bool = True):
    """FP8 e4m3 fake quantization per ``block`` contiguous elements of the last dim (``act_quant``,
    inplace=True).

    Why: the reference KV caches and (optionally) linear-layer activations hold exactly
    ``Cast(x.dtype, Cast(f32, Cast(e4m3, clamp(x/s, +-448))) * s)``, with
    ``amax = max(max|x|, 1e-4)``, ``s = ue8m0_ceil_scale(amax * fp32(1/448))`` if ``pow2`` (the
    ``scale_fmt="ue8m0"`` path) else ``amax * fp32(1/448)``.  Returns ``x``'s dtype and shape.
    """
    x = jnp.asarray(x)
    codes, s = _fp8_e4m3_blocks(x, block, pow2)
    y = e4m3_values(codes) * s
    return y.reshape(x.shape).astype(x.dtype)


def e4m3_values(codes):
    """float8_e4m3fn codes -> their fp32 values, from the bits by integer ops. Why not ``astype(float32)``: XLA's GPU
    pipeline removes chains of float conversions (``SimplifyFPConversions`` under ``xla_allow_excess_precision``, on
    by default), so ``x.astype(e4m3).astype(f32)`` compiles to no rounding at all on the H200; a bitcast breaks the
    chain. (NaN codes never reach here: the quantizers clip to ±448.)"""
    b = jax.lax.bitcast_convert_type(codes, jnp.uint8).astype(jnp.uint32)
    e, m = (b >> 3) & 0xF, b & 0x7
    normal = jax.lax.bitcast_convert_type(((e + 120) << 23) | (m << 20), jnp.float32)   # bias 7 -> 127
    magnitude = jnp.where(e == 0, m.astype(jnp.float32) * np.float32(2.0 ** -9), normal)  # subnormals: m x 2^-9
    return jnp.where(b >= 0x80, -magnitude, magnitude)


def _fp8_e4m3_blocks(x, block: int, pow2: bool):
    """(e4m3 codes [..., n/block, block], fp32 scales [..., n/block, 1]) of ``fp8_e4m3_sim``."""
    xb = _blocks(x, block)
    if pow2:
        codes, s = fp8_e4m3_row_codes(xb)
        return codes, s[..., None]
    q = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1, keepdims=True), _FP8_AMAX_FLOOR) * _FP8_MAX_INV
    return jnp.clip(_div_rn(xb, q), -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn), q


@partial(jax.jit, static_argnames=("block",))
def fp8_e4m3_codes(x, block: int):
    """``fp8_e4m3_sim(x, block)`` as (e4m3 codes [..., n], fp32 power-of-two scales [..., n/block]): codes x scale
    is the simulated value exactly. Why: FP8 tensor cores take the codes and the scale multiplies the product."""
    x = jnp.asarray(x)
    codes, s = _fp8_e4m3_blocks(x, block, True)
    return codes.reshape(x.shape), s[..., 0]


def fp8_e4m3_row_codes(x):
    """The power-of-two FP8 quantizer of ``fp8_e4m3_sim`` / ``fp8_e4m3_codes``, one scale block per row of the last
    axis ([..., block]): (e4m3 codes [..., block], fp32 scales [...]). Kernel-safe: no reshape, and the division by
    the power-of-two scale as a multiply by its exact reciprocal (written in the exponent field; XLA makes the same
    rewrite). Why one definition: XLA's path and the Triton kernels (the MoE op's activation codes kernel,
    `moe_gemm.act_codes`, and its in-kernel option) quantize with it."""
    e = fp8_e4m3_row_exponent(x)
    return fp8_e4m3_codes_at(x, e), _pow2_bits(e, jnp)


def fp8_e4m3_row_exponent(x):
    """The power-of-two FP8 scale's exponent (int32 [...]) of each row of the last axis ([..., block]): the first
    half of ``fp8_e4m3_row_codes``, apart so a kernel can take a row's amax from other registers than its codes
    (`moe_gemm.tile_operands`: the codes in the MMA's column order)."""
    return fp8_e4m3_exponent_of(jnp.max(jnp.abs(x), axis=-1))


def fp8_e4m3_exponent_of(amax):
    """The power-of-two FP8 scale's exponent (int32) for a block's amax (floored as ``fp8_e4m3_sim`` floors it)."""
    return _ceil_log2_bits(jnp.maximum(amax, _FP8_AMAX_FLOOR) * _FP8_MAX_INV, jnp)


def fp8_e4m3_codes_at(x, e):
    """x [..., m] -> its e4m3 codes under the power-of-two scales 2^e [...] (``fp8_e4m3_row_codes``'s second half)."""
    xs = x * _pow2_bits(-e, jnp)[..., None]
    return jnp.clip(xs, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)


def pow2_of(e):
    """2^e (fp32) for int32 exponents in [-126, 127], written in the exponent field (kernel-safe)."""
    return _pow2_bits(e, jnp)


@partial(jax.jit, static_argnames=("block", "scale_format"))
def fp4_e2m1_sim(x, block: int, *, scale_format: Literal["ue8m0", "e4m3"] = "ue8m0"):
    """FP4 e2m1 fake quantization per ``block`` contiguous elements of the last dim
    (``fp4_act_quant``, inplace=True).

    Why: the index keys / indexer queries (ue8m0, block 32) and V4.1's main compressed KV
    (e4m3 scale, block 16) are held as these values.
    ``ue8m0``: ``amax = max(max|x|, 6*2^-126)``, ``s = ue8m0_ceil_scale(amax * fp32(1/6))``.
    ``e4m3``:  ``amax = max(max|x|, 6*2^-9)``,  ``s = f32(e4m3_RNE(min(amax/6, 448)))`` (not a power
    of two; the kernel's satfinite cast saturates at 448).
    Then ``y = e2m1_RNE(clamp(x/s, +-6)) * s`` in fp32, returned in ``x``'s dtype.
    """
    x = jnp.asarray(x)
    xb = _blocks(x, block)
    amax = jnp.max(jnp.abs(xb), axis=-1, keepdims=True)
    if scale_format == "ue8m0":
        s = ue8m0_ceil_scale(jnp.maximum(amax, _FP4_UE8M0_AMAX_FLOOR) * _FP4_MAX_INV)
        xs = xb / s
    elif scale_format == "e4m3":
        q = jnp.minimum(_div_rn(jnp.maximum(amax, _FP4_E4M3_AMAX_FLOOR), FP4_MAX), np.float32(FP8_MAX))
        s = e4m3_values(q.astype(jnp.float8_e4m3fn))
        xs = _div_rn(xb, s)
    else:
        raise ValueError(f"scale_format must be 'ue8m0' or 'e4m3', got {scale_format!r}")
    y = e2m1_round(jnp.clip(xs, -FP4_MAX, FP4_MAX)) * s
    return y.reshape(x.shape).astype(x.dtype)


def hadamard_matrix(n: int) -> np.ndarray:
    """Sylvester natural-order Hadamard matrix H_n (entries +-1, H[i,j] = (-1)^popcount(i & j)), fp32."""
    if n <= 0 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    i = np.arange(n)
    parity = np.vectorize(lambda v: bin(v).count("1") & 1)(i[:, None] & i[None, :])
    return np.where(parity == 1, -1.0, 1.0).astype(np.float32)


@jax.jit
def hadamard(x):
    """y = x . H_n / sqrt(n) over the last dim (n a power of two), fp32 math, cast back to x.dtype.

    Why: the V4 indexer rotates q and index keys (``rotate_activation`` =
    ``fast_hadamard_transform(x, scale=n**-0.5)``) before FP4 fake quantization; the rotation is
    orthogonal, so only the quantization sees it.  Computed as the fast Walsh-Hadamard butterfly
    (log2 n add/sub stages, then one multiply by fp32(n**-0.5)), like the CUDA kernel, rather than
    an n x n matmul whose precision depends on the backend's matmul defaults.
    """
    x = jnp.asarray(x)
    n = x.shape[-1]
    if n <= 0 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    lead = x.shape[:-1]  # kept unflattened, so a head-sharded x stays sharded
    y = x.astype(jnp.float32)
    h = 1
    while h < n:
        y = y.reshape(lead + (n // (2 * h), 2, h))
        a, b = y[..., 0, :], y[..., 1, :]
        y = jnp.stack([a + b, a - b], axis=-2)
        h *= 2
    y = y.reshape(x.shape) * np.float32(n ** -0.5)
    return round_to(y, x.dtype)


# ----------------------------------------------------------------------------- E8M0 scales


def e8m0_to_f32(u8):
    """E8M0 byte b -> fp32 2^(b-127); b=0 -> 2^-127 (an fp32 subnormal), b=255 -> NaN.

    Why: checkpoint scales are F8_E8M0 (a bare biased exponent).  Accepts uint8/int8/float8_e8m0fnu
    raw bytes, numpy (numpy out) or jax.  Never raises; the dequantizers check for NaN bytes.
    """
    xp = _xp(u8)
    u = _as_u8(u8, xp).astype(np.uint32)
    bits = xp.where(u == 0, np.uint32(0x00400000), u << 23)
    bits = xp.where(u == 255, np.uint32(0x7FC00000), bits)
    return _bitcast(bits.astype(np.uint32), _F32, xp)


def f32_to_e8m0_exact(x):
    """fp32 power of two 2^e (e in [-127, 127]) -> its E8M0 byte e+127 (uint8); NaN -> 255.

    Why: writing scales back in checkpoint form.  The numpy path raises ValueError for anything
    that is not exactly representable (non-powers of two, zero, negatives, inf, out of range); the
    jax path cannot raise and just takes the fp32 exponent field.
    """
    xp = _xp(x)
    x = xp.asarray(x).astype(_F32)
    bits = _bitcast(x, np.uint32, xp)
    exp = (bits >> 23) & 0xFF
    byte = xp.where(bits == np.uint32(0x00400000), np.uint32(0), exp)  # 2^-127 is subnormal in fp32
    byte = xp.where(xp.isnan(x), np.uint32(255), byte).astype(np.uint8)
    if xp is np:
        ok = xp.isnan(x) | (bits == 0x00400000) | (((bits & 0x807FFFFF) == 0) & (exp >= 1) & (exp <= 254))
        if not np.all(ok):
            bad = x[~ok].ravel()[:4]
            raise ValueError(f"f32_to_e8m0_exact: not an exact power of two in [2^-127, 2^127]: {bad}")
    return byte


def _check_no_nan_scales(scale_u8, what: str):
    bad = np.asarray(scale_u8) == 255
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{what}: E8M0 scale byte 255 (NaN) at index {idx} ({int(bad.sum())} in total)")


# ----------------------------------------------------------------------------- FP8 block-scaled weights


def quantize_fp8_blocks(w, block=(128, 128)):
    """fp32 [..., out, in] -> (e4m3 [..., out, in], E8M0 bytes uint8 [..., ceil(out/Bo), ceil(in/Bi)]).

    Why: the checkpoint's FP8 linear format (random test weights, re-encoding).  Per Bo x Bi block
    (edge blocks may be ragged): ``amax = max(max|w|, 1e-4)`` (act_quant's floor; it only affects
    blocks with max|w| < 1e-4, e.g. all-zero ones, which get byte 105), exponent
    ``e = ceil(log2(amax * fp32(1/448)))`` from the bits, ``q = e4m3_RNE(clamp(w / 2^e, +-448))``,
    byte ``e + 127``.  numpy in -> numpy out (ml_dtypes.float8_e4m3fn, uint8); jax in -> jax out.
    """
    bo, bi = _block2(block)
    if _is_jax(w):
        return _quantize_fp8_jnp(w, bo, bi)
    return _quantize_fp8_impl(w, bo, bi, np)


def _quantize_fp8_impl(w, bo, bi, xp):
    w = xp.asarray(w).astype(_F32)
    *lead, out, inn = w.shape
    no, ni = -(-out // bo), -(-inn // bi)
    pad = [(0, 0)] * len(lead) + [(0, no * bo - out), (0, ni * bi - inn)]
    wb = xp.pad(w, pad).reshape(*lead, no, bo, ni, bi)  # zero padding leaves amax unchanged
    amax = xp.maximum(xp.max(xp.abs(wb), axis=(-3, -1)), _FP8_AMAX_FLOOR)
    e = _ceil_log2_bits(amax * _FP8_MAX_INV, xp)
    s = _pow2_bits(e, xp)[..., :, None, :, None]
    q = xp.clip(wb / s, -FP8_MAX, FP8_MAX).astype(_E4M3)
    q = q.reshape(*lead, no * bo, ni * bi)[..., :out, :inn]
    return q, (e + 127).astype(np.uint8)


_quantize_fp8_jnp = jax.jit(partial(_quantize_fp8_impl, xp=jnp), static_argnums=(1, 2))


def _expand_scale(s, shape, bo, bi, xp):
    """Per-block fp32 scale [..., no, ni] -> per element [..., out, in] (cropping ragged edges)."""
    out, inn = shape[-2:]
    s = xp.repeat(xp.repeat(s, bo, axis=-2), bi, axis=-1)
    return s[..., :out, :inn]


def dequantize_fp8_blocks(w_e4m3, scale_u8, block=(128, 128), dtype=jnp.float32):
    """e4m3 [..., out, in] + E8M0 bytes [..., ceil(out/Bo), ceil(in/Bi)] -> W [..., out, in] (fp32).

    Why: ``W[i,j] = e4m3(W[i,j]) * 2^(scale[i//Bo, j//Bi] - 127)`` (spec 5.1).  Exact in fp32
    (products are fp32-representable), so ``dtype=bf16`` costs one rounding only.  The weight may
    be given as float8_e4m3fn or as its raw uint8/int8 bytes.  numpy path (for the loader) raises
    ValueError on a scale byte 255 (NaN); jax path is jit-able and yields NaN there.
    """
    xp = _xp(w_e4m3, scale_u8)
    if xp is np:
        return dequantize_fp8_blocks_np(w_e4m3, scale_u8, block).astype(dtype)
    return _dequantize_fp8_jnp(w_e4m3, scale_u8, *_block2(block), dtype)


@partial(jax.jit, static_argnums=(2, 3, 4))
def _dequantize_fp8_jnp(w_e4m3, scale_u8, bo, bi, dtype):
    w = jnp.asarray(w_e4m3)
    if w.dtype != _E4M3:
        w = _bitcast(_as_u8(w, jnp), jnp.float8_e4m3fn, jnp)
    su = _as_u8(scale_u8, jnp)
    _check_scale_shape(w.shape, su.shape, bo, bi)
    s = _expand_scale(e8m0_to_f32(su), w.shape, bo, bi, jnp)
    return (w.astype(jnp.float32) * s).astype(dtype)


def _check_scale_shape(wshape, sshape, bo, bi):
    want = tuple(wshape[:-2]) + (-(-wshape[-2] // bo), -(-wshape[-1] // bi))
    if tuple(sshape) != want:
        raise ValueError(f"FP8 scale shape {tuple(sshape)} does not match weight {tuple(wshape)} with "
                         f"block ({bo}, {bi}); expected {want}")


def dequantize_fp8_blocks_np(w_e4m3, scale_u8, block=(128, 128)) -> np.ndarray:
    """numpy-only :func:`dequantize_fp8_blocks` (host loader): fp32 out, ValueError on NaN scales."""
    bo, bi = _block2(block)
    w = np.asarray(w_e4m3)
    if w.dtype != _E4M3:
        w = _as_u8(w, np).view(_E4M3)
    su = _as_u8(scale_u8, np)
    _check_scale_shape(w.shape, su.shape, bo, bi)
    _check_no_nan_scales(su, "dequantize_fp8_blocks")
    s = _expand_scale(e8m0_to_f32(su), w.shape, bo, bi, np)
    return w.astype(np.float32) * s


# ----------------------------------------------------------------------------- packed FP4 weights


def pack_fp4_codes(codes):
    """uint8 codes 0..15 [..., n] (n even) -> bytes [..., n/2]: low nibble = element 2k, high = 2k+1."""
    xp = _xp(codes)
    c = xp.asarray(codes).astype(np.uint8)
    if c.shape[-1] % 2:
        raise ValueError(f"FP4 packing needs an even last dim, got {c.shape[-1]}")
    return (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)


def unpack_fp4_codes(packed):
    """bytes [..., n/2] (uint8 or the checkpoint's int8) -> uint8 codes [..., n], inverse of pack_fp4_codes."""
    xp = _xp(packed)
    p = _as_u8(packed, xp)
    return xp.stack([p & 0xF, p >> 4], axis=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])


def quantize_fp4_packed(w, block: int = 32):
    """fp32 [..., out, in] -> (packed uint8 [..., out, in/2], E8M0 bytes uint8 [..., out, ceil(in/block)]).

    Why: the checkpoint's routed-expert format.  Per 1 x ``block`` block along ``in``:
    ``amax = max(max|w|, 6*2^-126)`` (fp4_quant_kernel's floor; all-zero blocks get byte 1),
    ``e = ceil(log2(amax * fp32(1/6)))``, code = e2m1_RNE(clamp(w / 2^e, +-6)) with table
    FP4_CODE_TABLE (sign in bit 3, so -0 -> code 8), byte ``e + 127``.  numpy or jax in/out.
    """
    if _is_jax(w):
        return _quantize_fp4_jnp(w, int(block))
    return _quantize_fp4_impl(w, int(block), np)


def _quantize_fp4_impl(w, block, xp):
    w = xp.asarray(w).astype(_F32)
    *lead, out, inn = w.shape
    if inn % 2:
        raise ValueError(f"FP4 packing needs an even input dim, got {inn}")
    nb = -(-inn // block)
    wb = xp.pad(w, [(0, 0)] * (len(lead) + 1) + [(0, nb * block - inn)]).reshape(*lead, out, nb, block)
    amax = xp.maximum(xp.max(xp.abs(wb), axis=-1), _FP4_UE8M0_AMAX_FLOOR)
    e = _ceil_log2_bits(amax * _FP4_MAX_INV, xp)
    v = xp.clip(wb / _pow2_bits(e, xp)[..., None], -FP4_MAX, FP4_MAX)
    codes = _e2m1_index(xp.abs(v), xp) | (xp.signbit(v).astype(np.int32) << 3)
    codes = codes.reshape(*lead, out, nb * block)[..., :inn]
    return pack_fp4_codes(codes), (e + 127).astype(np.uint8)


_quantize_fp4_jnp = jax.jit(partial(_quantize_fp4_impl, xp=jnp), static_argnums=(1,))


def _check_fp4_shapes(pshape, sshape, block):
    inn = 2 * pshape[-1]
    want = tuple(pshape[:-1]) + (-(-inn // block),)
    if tuple(sshape) != want:
        raise ValueError(f"FP4 scale shape {tuple(sshape)} does not match packed weight {tuple(pshape)} "
                         f"(in={inn}) with block {block}; expected {want}")


def _fp4_decode_arith(c):
    """code -> fp32 value without a gather: |v| = 0.5*m if e == 0 else (2+m) * 2^(e-2); sign = bit 3."""
    c = c.astype(jnp.int32)
    m = (c & 1).astype(jnp.float32)
    e = (c >> 1) & 3
    mag = jnp.where(e == 0, 0.5 * m, (2.0 + m) * jnp.where(e == 3, 2.0, jnp.where(e == 2, 1.0, 0.5)))
    return jnp.where((c & 8) != 0, -mag, mag).astype(jnp.float32)


def dequantize_fp4_packed(packed, scale_u8, block: int = 32, dtype=jnp.float32):
    """packed [..., out, in/2] + E8M0 bytes [..., out, ceil(in/block)] -> W [..., out, in] (fp32).

    Why: ``W[i,j] = code(i,j) * 2^(scale[i, j//block] - 127)`` (spec 5.1), used per matmul on
    device, so the jax path is jit-able and gather-free; the numpy path (for the loader) uses the
    code table and raises ValueError on a scale byte 255.  ``packed`` may be uint8 or int8.
    """
    xp = _xp(packed, scale_u8)
    if xp is np:
        return dequantize_fp4_packed_np(packed, scale_u8, block).astype(dtype)
    return _dequantize_fp4_jnp(packed, scale_u8, int(block), dtype)


@partial(jax.jit, static_argnums=(2, 3))
def _dequantize_fp4_jnp(packed, scale_u8, block, dtype):
    p = _as_u8(packed, jnp)
    su = _as_u8(scale_u8, jnp)
    _check_fp4_shapes(p.shape, su.shape, block)
    vals = _fp4_decode_arith(unpack_fp4_codes(p))
    s = jnp.repeat(e8m0_to_f32(su), block, axis=-1)[..., : vals.shape[-1]]
    return (vals * s).astype(dtype)


def dequantize_fp4_packed_np(packed, scale_u8, block: int = 32) -> np.ndarray:
    """numpy-only :func:`dequantize_fp4_packed` (host loader): fp32 out, ValueError on NaN scales."""
    p = _as_u8(packed, np)
    su = _as_u8(scale_u8, np)
    _check_fp4_shapes(p.shape, su.shape, block)
    _check_no_nan_scales(su, "dequantize_fp4_packed")
    vals = FP4_CODE_TABLE[unpack_fp4_codes(p)]
    s = np.repeat(e8m0_to_f32(su), block, axis=-1)[..., : vals.shape[-1]]
    return vals * s
