"""Per-row gathers: every row of a batch slot reads its own positions of its own caches."""

import jax
import jax.numpy as jnp


def take_rows(a, idx):
    """a [B, N, ...], idx int [B, ...] -> out[b, ...] = a[b, idx[b, ...]]."""
    return jax.vmap(lambda ab, ib: ab[ib])(a, idx)


def per_token(cfg, fn, *args):
    """fn over [B,T,...] arrays; token by token (`lax.map` over T) when `cfg.batch_invariant`.

    XLA picks matmul and reduction strategies by shape, so the same token computed in a chunk of 16 and in a
    chunk of 70 can differ in the last bit. Mapping over tokens gives every token the same [B, 1, ...] program
    whatever the chunk length: prefill chunks, decode steps and full forwards then agree bit for bit.
    """
    if not cfg.batch_invariant:
        return fn(*args)
    moved = [jnp.swapaxes(a, 0, 1)[:, :, None] for a in args]
    out = jax.lax.map(lambda xs: fn(*xs), moved)
    return jax.tree.map(lambda o: jnp.swapaxes(o[:, :, 0], 0, 1), out)
