"""Rounding and division the compiler may not rewrite.

XLA is allowed to keep bf16 intermediates in fp32 inside fusions ("excess precision"), which silently drops
the bf16 roundings the reference performs. `round_to` rounds with `lax.reduce_precision` first, an op XLA
must honour, so the reference presets keep the reference's numbers under `jit` as well as op by op.
Likewise XLA's algebraic simplifier turns `a / broadcast(b)` into `a * (1/b)`, which is not the correctly
rounded quotient; `div_exact` and `mean_exact` keep IEEE division as torch performs it.
"""

import jax
import jax.numpy as jnp

_BITS = {jnp.dtype(jnp.bfloat16): (8, 7), jnp.dtype(jnp.float16): (5, 10)}


def round_to(x, dtype):
    """x rounded (to nearest even) to `dtype` and returned in `dtype`."""
    dtype = jnp.dtype(dtype)
    if dtype in _BITS and x.dtype != dtype:
        e, m = _BITS[dtype]
        x = jax.lax.reduce_precision(x.astype(jnp.float32), exponent_bits=e, mantissa_bits=m)
    return x.astype(dtype)


def div_exact(a, b):
    """IEEE a / b with b broadcast to a's shape, hidden from the reciprocal rewrite by an optimization barrier."""
    a = jnp.asarray(a)
    b = jax.lax.optimization_barrier(jnp.broadcast_to(jnp.asarray(b, a.dtype), a.shape))
    return a / b


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


def silu(x):
    """x / (1 + exp(-x)), as torch's CPU silu computes it."""
    return div_exact(x, 1.0 + jnp.exp(-x))


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
