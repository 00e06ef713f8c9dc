"""The XLA path (baseline and fallback): one dense masked softmax partial per segment — every query scores the
segment's shared rows, the mask keeps the visible ones — the picks through the sparse MQA XLA partials, merged
by the flash combine. Scores are [B, T, H, N] per segment: bounded by the chunk length and the segment size."""

import jax.numpy as jnp

from dsjax.kernels.chunk_attention.api import visible
from dsjax.kernels.common import load_rows
from dsjax.kernels.sparse_mqa import xla as sparse_xla


def segment_partials(q, q_pos, seg, fmt, scale: float):
    """(max [B,T,H], sum [B,T,H], acc [B,T,H,d]) fp32 of q over one segment's visible rows."""
    keys = load_rows(seg.kv, fmt).astype(q.dtype)                                # [B, N, d], shared
    return sparse_xla.masked_partials(q, keys, visible(seg, q_pos), scale)


def chunk_attention(q, q_pos, sink, segments, picks, *, scale: float, row_format):
    parts = [segment_partials(q, q_pos, seg, row_format, scale) for seg in segments]
    if picks is not None:
        parts.append(sparse_xla.partials(q, picks[0], picks[1], row_format, scale))
    stacked = tuple(jnp.stack(x, axis=-2 if i < 2 else -3) for i, x in enumerate(zip(*parts)))
    return sparse_xla.combine(stacked, sink.astype(jnp.float32), q.dtype)
