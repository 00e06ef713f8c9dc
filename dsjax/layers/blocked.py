"""A function over blocks of one axis, one block after another: how a step whose intermediates grow with that axis
(the indexer's [queries, heads, keys] products, a Reindex layer's gathered candidate keys) keeps them within a
memory bound at any length."""

import jax
import jax.numpy as jnp


def map_in_blocks(fn, args, *, axis: int, block: int, out_axis: int):
    """fn(*args) computed over `block`-long slices of every arg's `axis` (the last slice zero-padded), in sequence
    (`lax.map`), the outputs joined along `out_axis` and cut back to the axis' length. fn must treat the
    positions of `axis` independently, so the blocked result is the one-piece result; one piece when block >= the
    length."""
    size = args[0].shape[axis]
    if block >= size:
        return fn(*args)
    n = -(-size // block)

    def split(a):                                    # [..., size, ...] -> [n, ..., block, ...]
        pad = [(0, 0)] * a.ndim
        pad[axis] = (0, n * block - size)
        a = jnp.pad(a, pad)
        return jnp.moveaxis(a.reshape(a.shape[:axis] + (n, block) + a.shape[axis + 1:]), axis, 0)

    out = jnp.moveaxis(jax.lax.map(lambda xs: fn(*xs), tuple(split(a) for a in args)), 0, out_axis)
    out = out.reshape(out.shape[:out_axis] + (n * block,) + out.shape[out_axis + 2:])
    return jax.lax.slice_in_dim(out, 0, size, axis=out_axis)
