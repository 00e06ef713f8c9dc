"""The definition of chunk attention in plain jnp (tests only): every query's visible keys gathered into one
list — the segments' rows it sees, in order, then its picks — and the model's own sink softmax."""

import jax.numpy as jnp

from dsjax.kernels.chunk_attention.api import visible
from dsjax.kernels.common import load_rows
from dsjax.kernels.sparse_mqa.reference import gather_keys
from dsjax.layers.attention import sink_attention


def chunk_attention(q, q_pos, sink, segments, picks, *, scale: float, row_format):
    B, T = q.shape[:2]
    dt = q.dtype
    keys, valid = [], []
    for seg in segments:
        rows = load_rows(seg.kv, row_format).astype(dt)                          # [B, N, d]
        keys.append(jnp.broadcast_to(rows[:, None], (B, T) + rows.shape[1:]))
        valid.append(visible(seg, q_pos))
    if picks is not None:
        k, v = gather_keys(picks[0], picks[1], row_format, dt)
        keys.append(k)
        valid.append(v)
    keys = jnp.concatenate(keys, axis=2)
    valid = jnp.concatenate(valid, axis=2)
    return sink_attention(q, keys, valid, sink, scale)
