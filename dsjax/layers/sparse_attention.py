"""Attention through the kernels: the sparse MQA kernel (`dsjax.kernels.sparse_mqa`: the cache's stored rows and
per-query index lists instead of gathered key copies) for decode / verify, the chunk attention kernel
(`dsjax.kernels.chunk_attention`: shared window and HCA rows, block-sparse) for prefill chunks.

The same keys in the same order as `attention`'s XLA path — the window (ring, then this chunk) and the CSA
picks or every completed HCA entry — so the result is `sink_attention`'s up to the kernel's split softmax
(docs/kernels.md states the tolerance). Used when `dsjax.kernel_choice` picks the Pallas kernel.
"""

import jax
import jax.numpy as jnp

from dsjax import kv_rows
from dsjax.kernel_choice import choose
from dsjax.kernels import chunk_attention as chunk_op, sparse_mqa
from dsjax.kernels.indexer_topk import indexer_topk
from dsjax.kernels.common import IndexRowFormat, MainRowFormat
from dsjax.layers.indexer import index_scores, index_weights, select_topk


def pick_entries(x, iq, w, cfg, index_entries, q_pos, ratio: int, visible):
    """The CSA layer's top-k compressed entries per query (indices, valid): the indexer kernel on the stored
    index-key rows when `dsjax.kernel_choice` picks it, else the model's XLA scoring + top-k."""
    B, T = q_pos.shape
    if choose(cfg, "indexer_topk", rows=B * T, chunk=T, dtype=x.dtype, operands=(index_entries,)) == "pallas":
        keys = index_entries if kv_rows.index_rows_compact(cfg) else index_entries.astype(x.dtype)
        return indexer_topk(iq, index_weights(x, w, cfg), keys, (q_pos + 1) // ratio, cfg.index_topk,
                            row_format=IndexRowFormat.from_config(cfg), implementation="pallas")
    scores = index_scores(x, iq, kv_rows.load_index(index_entries, cfg), w, cfg)
    return select_topk(scores, visible, cfg.index_topk)


def sparse_attention(q, sink, ring, kv_stored, comp, chosen, cfg, ratio: int, start):
    """q [B,T,H,d] at positions start+t; ring / kv_stored the window ring and this chunk's stored rows; comp the
    layer's CompressorState after this chunk (None without compression); chosen the indexer's (indices, valid)
    for CSA layers, None for HCA. Returns o [B,T,H,d] before the inverse rope."""
    T = q.shape[1]
    fmt = MainRowFormat.from_config(cfg)
    window = sparse_mqa.window_rows(ring, kv_stored)
    win_idx = sparse_mqa.window_indices(start, T, cfg.window_size)
    comp_kv = comp_idx = None
    if ratio:
        comp_kv = comp.entries
        if chosen is not None:
            comp_idx = sparse_mqa.csa_indices(*chosen)
        else:
            q_pos = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
            comp_idx = sparse_mqa.hca_indices(q_pos, comp_kv.shape[1], ratio)
    if not kv_rows.main_rows_compact(cfg):
        window, comp_kv = window.astype(q.dtype), None if comp_kv is None else comp_kv.astype(q.dtype)
    return sparse_mqa.sparse_mqa_decode(q, sink, window, win_idx, comp_kv, comp_idx, scale=cfg.head_dim ** -0.5,
                                        row_format=fmt, implementation="pallas")


# The prefill kernel behind kernels="pallas": "mosaic" (the wgmma kernel, 7-22% less device time than the Triton
# one on the H200 at V4 shapes, docs/benchmarks.md), "triton", or "auto": Mosaic GPU on a GPU, the Triton kernel
# through the HLO interpreter elsewhere (Mosaic GPU's interpreter runs a thread per warpgroup: tests only)
CHUNK_ATTENTION_BACKEND = "auto"


def chunk_attention_backend() -> str:
    if CHUNK_ATTENTION_BACKEND != "auto":
        return CHUNK_ATTENTION_BACKEND
    return "mosaic" if jax.default_backend() == "gpu" else "triton"


def chunk_attention(q, sink, ring, kv_stored, comp, chosen, cfg, ratio: int, start):
    """As `sparse_attention`, for a prefill chunk: the window and every HCA entry as shared segments (each
    visible to an interval of positions), CSA picks as per-query lists. Returns o [B,T,H,d] before the
    inverse rope."""
    T = q.shape[1]
    fmt = MainRowFormat.from_config(cfg)
    cast = (lambda x: x) if kv_rows.main_rows_compact(cfg) else (lambda x: x.astype(q.dtype))
    q_pos = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    segments = [chunk_op.window_segment(cast(ring), cast(kv_stored), start, cfg.window_size)]
    picks = None
    if ratio and chosen is not None:
        picks = (cast(comp.entries), sparse_mqa.csa_indices(*chosen))
    elif ratio:
        segments.append(chunk_op.compressed_segment(cast(comp.entries), ratio))
    return chunk_op.chunk_attention(q, q_pos, sink, segments, picks, scale=cfg.head_dim ** -0.5, row_format=fmt,
                                    implementation="pallas", backend=chunk_attention_backend())
