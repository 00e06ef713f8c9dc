"""Rounding and division the compiler may not rewrite.

XLA is allowed to keep bf16 intermediates in fp32 inside fusions ("excess precision"), which silently drops
the bf16 roundings the reference performs. `round_to` rounds with `lax.reduce_precision` first, an op XLA
must honour, so the reference presets keep the reference's numbers under `jit` as well as op by op.
Likewise XLA's algebraic simplifier turns `a / broadcast(b)` into `a * (1/b)`, which is not the correctly
rounded quotient; `div_exact` and `mean_exact` keep IEEE division as torch performs it (on the CPU). On the GPU
XLA's f32 division is not correctly rounded at all (its quotients are an ulp or two off, like `a * (1/b)`);
`div_rn` corrects the quotient there with an exact residual (`quotient_rn`). The quantizers use it, where one ulp
can move a scale or a code; elsewhere an ulp is within every GPU tolerance and the correction costs step time
(H200: a V4-Flash slice's decode / verify step 0.7% / 1.2% slower with it in every division, docs/numerics.md).
"""

import jax
import jax.numpy as jnp
import numpy as np

_BITS = {jnp.dtype(jnp.bfloat16): (8, 7), jnp.dtype(jnp.float16): (5, 10)}


def round_to(x, dtype):
    """x rounded (to nearest even) to `dtype` and returned in `dtype`."""
    dtype = jnp.dtype(dtype)
    if dtype in _BITS and x.dtype != dtype:
        e, m = _BITS[dtype]
        x = jax.lax.reduce_precision(x.astype(jnp.float32), exponent_bits=e, mantissa_bits=m)
    return x.astype(dtype)


def div_exact(a, b):
    """IEEE a / b with b broadcast to a's shape, hidden from the reciprocal rewrite by an optimization barrier (IEEE
    on the CPU; on the GPU XLA's division is an ulp or two off: `div_rn` where that matters)."""
    a, b = _hidden_divisor(a, b)
    return a / b


def div_rn(a, b):
    """The correctly rounded a / b on every platform: `div_exact`, then on accelerators the quotient corrected
    (`quotient_rn`). For quantizer scales and codes, where one ulp can change a stored byte."""
    a, b = _hidden_divisor(a, b)
    q = a / b
    return _rounded_quotient(a, b, q) if a.dtype == jnp.float32 else q


def _hidden_divisor(a, b):
    """(a, b broadcast to a's shape behind an optimization barrier): the simplifier cannot see b to rewrite a / b."""
    a = jnp.asarray(a)
    return a, jax.lax.optimization_barrier(jnp.broadcast_to(jnp.asarray(b, a.dtype), a.shape))


@jax.custom_jvp
def _rounded_quotient(a, b, q):
    """q made the correctly rounded a / b where the platform's division is not (not on the CPU)."""
    return jax.lax.platform_dependent(a, b, q, cpu=lambda a, b, q: q, default=quotient_rn)


@_rounded_quotient.defjvp
def _rounded_quotient_jvp(primals, tangents):
    """The derivative is the division's (through q): the correction moves values by an ulp and has none."""
    return _rounded_quotient(*primals), tangents[2]


def _high_half(x):
    """x with the low 12 of its 23 stored mantissa bits cleared: 12 significant bits, so products of two such
    halves are exact in fp32."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32) & np.uint32(0xFFFFF000)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _residual(a, b, c):
    """a - c*b rounded once, for c within a few ulp of a/b.

    c and b split into 12-bit halves make four exact products, and the first three subtractions are exact
    (Sterbenz, then results on a grid they fit), so only the last rounds. Every product is exact, so fused
    multiply-adds (which the GPU compiler may form) change nothing."""
    ch, bh = _high_half(c), _high_half(b)
    cl, bl = c - ch, b - bh
    return (((a - ch * bh) - ch * bl) - cl * bh) - cl * bl


def _round_step(a, b, q):
    """q moved one ulp towards a/b (b > 0) unless it already is the nearest float.

    Why one rounding does not matter: a - m*b for the midpoint m next to q is a nonzero multiple of
    ulp(m) * ulp(b) / 2, which is the ulp of the residual near m, so the rounded residual minus the exactly
    computed half gap (Sterbenz) has the sign of the exact one; and a quotient is never exactly a midpoint."""
    r = _residual(a, b, q)                             # a/b - q = r / b
    up = jnp.nextafter(q, np.float32(np.inf))
    down = jnp.nextafter(q, np.float32(-np.inf))
    half_up = (up - q) * np.float32(0.5) * b           # exact: a power of two times b
    half_down = (q - down) * np.float32(0.5) * b
    return jnp.where(r > half_up, up, jnp.where(r < -half_down, down, q))


def quotient_rn(a, b, q):
    """The correctly rounded fp32 a / b, given any q within 2 ulp of it (what the GPU's division returns).

    Two residual checks (`_round_step`), each moving q one ulp. Outside 2^-70 <= |a| <= 2^100, 2^-60 <= |b| <= 2^60,
    2^-100 <= |q| <= 2^100 (zeros, infinities, NaN, values near underflow) q is returned as it is: there a
    product in the residual could leave fp32's normal range, and such quotients round to zero in every
    quantizer that uses this."""
    sign = jnp.where(b < 0, np.float32(-1.0), np.float32(1.0))
    a, b, q0 = a * sign, b * sign, q
    within = ((jnp.abs(a) >= 2.0 ** -70) & (jnp.abs(a) <= 2.0 ** 100) & (b >= 2.0 ** -60) & (b <= 2.0 ** 60)
              & (jnp.abs(q) >= 2.0 ** -100) & (jnp.abs(q) <= 2.0 ** 100))
    q = jnp.where(within, q, np.float32(1.0))          # keeps the residual's products finite where unused
    return jnp.where(within, _round_step(a, b, _round_step(a, b, q)), q0)


def mean_exact(x, axis, keepdims: bool = True):
    """sum / n as a division (what torch's mean computes), not a multiplication by 1/n."""
    s = jnp.sum(x, axis=axis, keepdims=keepdims)
    n = x.shape[axis] if isinstance(axis, int) else int(__import__("math").prod(x.shape[a] for a in axis))
    return div_exact(s, jnp.full((), n, s.dtype))


def softmax_exact(x, axis: int):
    """exp(x - max) / sum(exp(x - max)) with an IEEE division (torch's softmax)."""
    m = jnp.max(x, axis=axis, keepdims=True)
    e = jnp.exp(x - jnp.where(jnp.isfinite(m), m, 0.0))
    return div_exact(e, jnp.sum(e, axis=axis, keepdims=True))


def materialize(*xs):
    """Force products to be rounded before they are summed: no fused multiply-add (torch does none)."""
    out = jax.lax.optimization_barrier(xs)
    return out if len(xs) > 1 else out[0]


def sigmoid(x):
    """1 / (1 + exp(-x)) with an IEEE division, as torch's CPU sigmoid computes it."""
    return div_exact(jnp.ones_like(x), 1.0 + jnp.exp(-x))


def silu(x, divide=None):
    """x / (1 + exp(-x)), as torch's CPU silu computes it. divide: the division (default `div_exact`; kernels pass
    a plain one, as Pallas lowers no optimization barrier and nothing there rewrites it)."""
    return (divide or div_exact)(x, 1.0 + jnp.exp(-x))


def softplus(x):
    """torch's softplus (beta 1, threshold 20): log1p(exp(x)), or x itself above 20."""
    return jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))


def sum_in_order(x, axis: int):
    """((x0 + x1) + x2) + ... along a short axis: torch's order for reductions over an outer dimension."""
    parts = [jax.lax.index_in_dim(x, i, axis, keepdims=False) for i in range(x.shape[axis])]
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total
