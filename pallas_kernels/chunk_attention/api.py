"""Chunk (prefill) attention over shared key rows: the op contract, the key segments of a V4 layer, and backend
selection.

A prefill chunk's queries do not need per-query key lists for most of their keys: the window and the HCA entries
are *shared* rows, each visible to an interval of query positions. Key n of a segment is visible to the query at
position p iff lo[n] <= p < hi[n]:

- window rows (the ring in position order, then the chunk): lo = position, hi = position + window;
- compressed entry j (complete once its `ratio` tokens are): lo = (j+1)·ratio - 1, hi = +inf.

lo and hi are nondecreasing along a segment, so the keys visible to a block of consecutive queries form one
contiguous range: the Pallas kernel visits only those key blocks (a 128-key window costs the same at 1M context
as at 8k). CSA picks differ per query and come as an index list over the compressed entries (`picks`), attended
by the sparse MQA kernel's split partials and merged with the same flash combine.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dsjax.kernels.common import MainRowFormat, check_implementation, pick_backend

NEVER = jnp.iinfo(jnp.int32).max     # lo = hi = NEVER: a padding row no query sees


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Segment:
    """Shared key rows kv [B, N, R] (uint8 compact rows or values) visible to positions lo[b,n] <= p < hi[b,n]
    (int32 [B, N], both nondecreasing in n)."""
    kv: jax.Array
    lo: jax.Array
    hi: jax.Array


def window_segment(ring, chunk_rows, start, window: int) -> Segment:
    """The sliding window as one segment: ring [B, W, R] (slot s holds the latest position p < start with
    p ≡ s mod W) put in position order, then the chunk's rows [B, T, R] at start + t. Slots never written
    (p < 0) get lo = hi = -1: visible to no query."""
    B, W = ring.shape[:2]
    T = chunk_rows.shape[1]
    order = (start[:, None] + jnp.arange(W)[None, :]) % W                      # oldest slot first
    ring_sorted = jnp.take_along_axis(ring, order[..., None], axis=1)
    pos = jnp.concatenate([start[:, None] - W + jnp.arange(W)[None, :],
                           start[:, None] + jnp.arange(T)[None, :]], axis=1).astype(jnp.int32)
    lo = jnp.where(pos >= 0, pos, -1)
    hi = jnp.where(pos >= 0, pos + window, -1)
    return Segment(jnp.concatenate([ring_sorted, chunk_rows.astype(ring.dtype)], axis=1), lo, hi)


def compressed_segment(entries, ratio: int) -> Segment:
    """Compressed entries [B, N, R] as a segment: entry j is complete, so visible, from position (j+1)·ratio - 1
    on (j < (p+1)//ratio)."""
    B, N = entries.shape[:2]
    lo = jnp.broadcast_to((jnp.arange(N, dtype=jnp.int32) + 1) * ratio - 1, (B, N))
    return Segment(entries, lo, jnp.full((B, N), NEVER, jnp.int32))


def chunk_attention(q, q_pos, sink, segments, picks=None, *, scale: float,
                    row_format: MainRowFormat = MainRowFormat(), implementation: str = "xla", **kernel_options):
    """Attention of a chunk's queries over shared key segments and optional per-query picks.

    q:        [B, T, H, d] compute dtype; q_pos int32 [B, T] the queries' positions, ascending along T.
    sink:     [H] fp32 per-head sink logit (denominator only).
    segments: [Segment]: shared rows with interval visibility (`window_segment`, `compressed_segment`).
    picks:    None or (kv [B, Nc, R], idx int32 [B, T, K]): per-query rows of kv (CSA top-k), -1 = none.
    Returns [B, T, H, d] in q.dtype: `dsjax.layers.attention.sink_attention` over each query's visible keys
    (segments in order, then its picks); 0 for a query with no visible key.

    implementation: "reference" (tests), "xla" (dense masked partials per segment), "pallas" (a flash kernel
    visiting only the visible key blocks). kernel_options go to the Pallas kernel only: backend "triton" (default;
    block_q, block_k, num_warps, num_stages, interpret — the HLO interpreter off-GPU) or "mosaic" (Mosaic GPU,
    wgmma with the head dimension split over two warpgroups; block_k, stages, exchange_buffers, overlap_qk,
    interpret — Mosaic GPU interpret mode off-GPU).
    """
    from dsjax.kernels.chunk_attention import pallas_gpu, pallas_triton, reference, xla
    impl = check_implementation(implementation)
    args = (q, q_pos, sink, list(segments), picks)
    if impl == "reference":
        return reference.chunk_attention(*args, scale=scale, row_format=row_format)
    if impl == "xla":
        return xla.chunk_attention(*args, scale=scale, row_format=row_format)
    module = pick_backend(kernel_options, {"triton": pallas_triton, "mosaic": pallas_gpu})
    return module.chunk_attention(*args, scale=scale, row_format=row_format, **kernel_options)


def visible(seg: Segment, q_pos):
    """bool [B, T, N]: which rows of the segment each query sees."""
    return (seg.lo[:, None, :] <= q_pos[..., None]) & (q_pos[..., None] < seg.hi[:, None, :])
