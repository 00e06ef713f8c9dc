"""RMSNorm exactly as the reference computes it: fp32 statistics, fp32 weight, result in the input dtype."""

import jax
import jax.numpy as jnp
from dsjax.numerics import mean_exact, round_to


def rms_norm(x, weight, eps: float):
    """x * rsqrt(mean(x²) + eps) * weight over the last dim; `weight` may be bf16 (upcast is exact)."""
    dtype = x.dtype
    xf = x.astype(jnp.float32)
    var = mean_exact(xf * xf, axis=-1)
    return round_to(weight.astype(jnp.float32) * (xf * jax.lax.rsqrt(var + eps)), dtype)


def weightless_head_norm(q, eps: float):
    """V4's per-head q normalisation, done in q's own dtype as the reference does (bf16 ops in bf16).

    Every intermediate is rounded to q.dtype, mirroring `q *= rsqrt(q.square().mean(-1) + eps)` on a bf16
    tensor; for float32 q this is the plain formula.
    """
    dt = q.dtype
    qf = q.astype(jnp.float32)
    sq = round_to(qf * qf, dt).astype(jnp.float32)
    mean = round_to(mean_exact(sq, axis=-1), dt).astype(jnp.float32)
    r = round_to(jax.lax.rsqrt(round_to(mean + eps, dt).astype(jnp.float32)), dt).astype(jnp.float32)
    return round_to(qf * r, dt)
