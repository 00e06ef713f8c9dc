"""Per-row gathers: every row of a batch slot reads its own positions of its own caches."""

import jax


def take_rows(a, idx):
    """a [B, N, ...], idx int [B, ...] -> out[b, ...] = a[b, idx[b, ...]]."""
    return jax.vmap(lambda ab, ib: ab[ib])(a, idx)
