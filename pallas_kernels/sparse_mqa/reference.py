"""The definition of sparse shared-KV MQA decode attention, in plain jnp: readable first, fast never (tests only).

Gathers every query's key list (its window entries, then its compressed entries), dequantises the rows to the
compute dtype and runs the model's sink softmax: fp32 logits, max over the valid keys, probabilities rounded to
the compute dtype before P·V, the per-head sink only in the denominator, 0 for a query with no valid key.
"""

import jax
import jax.numpy as jnp

from dsjax.layers.attention import sink_attention
from dsjax.kernels.common import load_rows


def gather_keys(kv, idx, fmt, dtype):
    """kv [B,N,R] stored rows, idx int32 [B,Q,K] (-1 = none) -> keys [B,Q,K,d] in dtype, valid [B,Q,K]."""
    rows = jax.vmap(lambda kb, ib: kb[jnp.maximum(ib, 0)])(kv, idx)
    return load_rows(rows, fmt).astype(dtype), idx >= 0


def sparse_mqa_decode(q, sink, window_kv, window_idx, comp_kv, comp_idx, *, scale: float, row_format):
    dt = q.dtype
    keys, valid = gather_keys(window_kv, window_idx, row_format[0], dt)
    if comp_kv is not None:
        c_keys, c_valid = gather_keys(comp_kv, comp_idx, row_format[1], dt)
        keys, valid = jnp.concatenate([keys, c_keys], axis=2), jnp.concatenate([valid, c_valid], axis=2)
    return sink_attention(q, keys, valid, sink, scale)  # the model's own definition, not a copy
