"""Rounding the compiler may not skip.

XLA is allowed to keep bf16 intermediates in fp32 inside fusions ("excess precision"), which silently drops
the bf16 roundings the reference performs. `round_to` rounds with `lax.reduce_precision` first, an op XLA
must honour, so the reference presets keep the reference's numbers under `jit` as well as op by op.
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
