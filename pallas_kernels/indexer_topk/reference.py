"""The definition of lightning-indexer scoring + top-k in plain jnp (tests only).

score[t] = Σ_h relu(q_h · K[t]) · w_h with the model's roundings to the compute dtype (the dot, each weighted
head, the head sum); entries j ≥ n_visible are masked; `lax.top_k` breaks ties toward the lower index.
"""

import jax
import jax.numpy as jnp

from dsjax.numerics import round_to
from dsjax.kernels.common import load_rows


def index_scores(q, weights, keys, row_format):
    """q [B,Q,nh,dh], weights [B,Q,nh] (compute dtype), keys [B,N,R] stored rows -> scores [B,Q,N] (compute dtype)."""
    dt = q.dtype
    k = load_rows(keys, row_format).astype(dt)
    s = jnp.einsum("bqhd,bnd->bqhn", q.astype(jnp.float32), k.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    s = round_to(s, dt)
    s = round_to(jnp.maximum(s, 0).astype(jnp.float32) * weights[..., None].astype(jnp.float32), dt)
    return round_to(jnp.sum(s.astype(jnp.float32), axis=2), dt)


def indexer_topk(q, weights, keys, n_visible, k: int, *, row_format):
    scores = index_scores(q, weights, keys, row_format)
    visible = jnp.arange(scores.shape[-1]) < n_visible[..., None]
    top, idx = jax.lax.top_k(jnp.where(visible, scores.astype(jnp.float32), -jnp.inf), min(k, scores.shape[-1]))
    return idx.astype(jnp.int32), jnp.isfinite(top)
