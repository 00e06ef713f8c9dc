"""The XLA path: dense scoring over the dequantised index keys, then a two-stage top-k (per tile, then over the
tiles' candidates) so 262k-entry rows never go through one huge sort."""

import jax
import jax.numpy as jnp

from dsjax.kernels.common import load_rows, pad_axis, round_bf


def index_scores(q, weights, keys, row_format):
    """Scores [B,Q,N] in fp32 holding compute-dtype values (the reference's roundings)."""
    dt = q.dtype
    k = load_rows(keys, row_format).astype(dt)
    s = round_bf(jnp.einsum("bqhd,bnd->bqhn", q, k, preferred_element_type=jnp.float32), dt)
    s = round_bf(jnp.maximum(s, 0) * weights[..., None].astype(jnp.float32), dt)
    return round_bf(jnp.sum(s, axis=2), dt)


def topk_lower_index(scores, n_visible, k: int, tile: int = 4096):
    """Top-k of scores [..., N] over entries j < n_visible[...]: (int32 indices, valid), ties to the lower index.

    Stage 1 keeps each tile's top-k (ties lower-index first within the tile); stage 2 runs top-k over the
    candidates laid out tile by tile, so among equal scores a lower candidate position is a lower index.
    """
    N = scores.shape[-1]
    k = min(k, N)
    masked = jnp.where(jnp.arange(N) < n_visible[..., None], scores, -jnp.inf)
    if N <= tile:
        top, idx = jax.lax.top_k(masked, k)
        return idx.astype(jnp.int32), jnp.isfinite(top)
    masked = pad_axis(masked, -1, tile, -jnp.inf)
    tiles = masked.reshape(masked.shape[:-1] + (-1, tile))
    kt = min(k, tile)
    cand, local = jax.lax.top_k(tiles, kt)                                        # [..., n_tiles, kt]
    glob = local + (jnp.arange(tiles.shape[-2]) * tile)[:, None]
    top, pos = jax.lax.top_k(cand.reshape(cand.shape[:-2] + (-1,)), k)
    idx = jnp.take_along_axis(glob.reshape(glob.shape[:-2] + (-1,)), pos, axis=-1)
    # Padding sorts last among -inf picks only if it has the highest indices: it does (appended at the end).
    return idx.astype(jnp.int32), jnp.isfinite(top)


def indexer_topk(q, weights, keys, n_visible, k: int, *, row_format, tile: int = 4096):
    return topk_lower_index(index_scores(q, weights, keys, row_format), n_visible, k, tile)
