"""Sparse shared-KV MQA decode attention with a per-head sink: the op contract and backend selection."""

import jax.numpy as jnp

from dsjax.kernels.common import MainRowFormat, check_implementation
from dsjax.kernels.sparse_mqa import pallas_triton, reference, xla


def sparse_mqa_decode(q, sink, window_kv, window_idx, comp_kv=None, comp_idx=None, *, scale: float,
                      row_format: MainRowFormat = MainRowFormat(), implementation: str = "xla", **kernel_options):
    """Attention of k+1 verify queries per slot over their windows and their selected compressed entries.

    q:          [B, Q, H, d] compute dtype (Q = k+1 verify queries per slot, H = heads on this TP shard).
    sink:       [H] fp32 per-head sink logit (denominator only).
    window_kv:  [B, Nw, R] stored main-KV rows: the window ring followed by this chunk's rows
                (`window_rows`), uint8 compact rows (`row_format`) or values [B, Nw, d].
    row_format: the rows' layout, or (window layout, compressed layout) when they differ — V4.1: window rows
                `MainRowFormat(nope=d, rope=0, block=32)` (528 B), compressed rows `Fp4RowFormat` (288 B).
    window_idx: int32 [B, Q, Kw] rows of window_kv per query, oldest first; -1 = no key (`window_indices`).
    comp_kv:    [B, Nc, R] the compressed entries (CompressorState.entries), or None (window-only layers).
    comp_idx:   int32 [B, Q, Kc] entries per query: CSA top-k picks, HCA every completed entry
                (`hca_indices`); -1 = none.
    Returns [B, Q, H, d] in q.dtype: what `dsjax.layers.attention.sink_attention` gives on the gathered key
    list (window keys, then compressed keys); 0 for a query with no valid key.

    implementation: "reference" (tests), "xla" (gather + dense softmax), "pallas" (Triton-lowered Pallas
    kernel, split over keys; the HLO interpreter off-GPU). kernel_options (block_k, head_block, num_splits,
    num_warps, num_stages, interpret) go to the Pallas kernel only.
    """
    impl = check_implementation(implementation)
    args = (q, sink, window_kv, window_idx, comp_kv, comp_idx)
    row_format = row_format if isinstance(row_format, tuple) else (row_format, row_format)
    if impl == "reference":
        return reference.sparse_mqa_decode(*args, scale=scale, row_format=row_format)
    if impl == "xla":
        return xla.sparse_mqa_decode(*args, scale=scale, row_format=row_format)
    return pallas_triton.sparse_mqa_decode(*args, scale=scale, row_format=row_format, **kernel_options)


def window_rows(ring, chunk_rows):
    """[B, W, R] ring + [B, T, R] this chunk's stored rows -> the window source [B, W+T, R]."""
    return jnp.concatenate([ring, chunk_rows.astype(ring.dtype)], axis=1)


def window_indices(start, n_queries: int, window: int):
    """int32 [B, T, W]: per query at start[b]+t, its window rows in `window_rows` order (as
    dsjax.layers.attention.window_keys gathers them), -1 before position 0."""
    q_pos = start[:, None] + jnp.arange(n_queries)[None, :]
    k_pos = q_pos[..., None] - (window - 1) + jnp.arange(window)
    st = start[:, None, None]
    src = jnp.where(k_pos >= st, window + k_pos - st, k_pos % window)
    return jnp.where(k_pos >= 0, src, -1).astype(jnp.int32)


def hca_indices(q_pos, n_entries: int, ratio: int):
    """int32 [B, T, N]: every completed compressed entry (j < (q+1)//ratio), -1 for the rest."""
    j = jnp.arange(n_entries, dtype=jnp.int32)
    return jnp.where(j < ((q_pos + 1) // ratio)[..., None], j, -1)


def csa_indices(chosen, chosen_ok):
    """The indexer's picks (`select_topk` / `indexer_topk`) as an index list: -1 where not valid."""
    return jnp.where(chosen_ok, chosen, -1).astype(jnp.int32)
