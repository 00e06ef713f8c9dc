"""V4.1 attention (CSA2): a sliding window plus compressed KV shared across layers (spec §3.8, §2.2).

Roles, by layer: KV sources compress their own KV (ratio 2: gated softmax over 2 tokens, no ape, no overlap;
ratio 1: a normed projection) and derive index keys from the pre-RoPE latent; index sources score the compressed
entries with their own indexer (no Hadamard in V4.1); the candidate source also publishes its best blocks, to
which the later index sources (Reindex) restrict their top-k; Reuse layers take the last published top-k and
their source's compressed KV. Main compressed KV is FP4 with e4m3 scales per 16 values; window KV FP8 over all
512 dims (block 32); index keys and queries FP4 with ue8m0 scales per 32.

Like V4's `attention`, one function serves prefill chunks, decode steps and verify blocks: each query gathers a
fixed-length key list (window, then its compressed picks), so results do not depend on the chunking.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsjax import quant, v41_rows
from dsjax.config import ModelConfig
from dsjax.kernel_choice import choose
from dsjax.sharding import active_mesh
from dsjax.kernels import sparse_mqa
from dsjax.kernels.common import Fp4RowFormat, MainRowFormat
from dsjax.layers.attention import (attend_keys, chunk_projections, compressed_visible, unrotated_output, update_ring,
                                   window_keys)
from dsjax.layers import radix_topk, reindex
from dsjax.layers.chunk_indexer import chunk_index_scores
from dsjax.layers.linear import linear, matmul
from dsjax.layers.norms import rms_norm
from dsjax.layers.rope import apply_rope, rope_angles
from dsjax.layers.rows import per_token, take_rows
from dsjax.numerics import materialize, round_to, softmax_exact
from dsjax.v41_state import LayerState41, SourceState41
from dsjax.v41_weights import Attention41, Compressor41, Indexer41, index_source_of, kv_source_of

MAIN_KV_BLOCK = 16  # FP4 main KV: one e4m3 scale per 16 values


def project_q(x, w: Attention41, cfg: ModelConfig, angles):
    """x [b,s,D] -> (q [b,s,H,d] rotated, qr [b,s,q_lora]); V4.1 has no per-head q norm."""
    b, s, _ = x.shape
    qr = rms_norm(linear(x, w.wq_a, cfg), w.q_norm, cfg.norm_eps)
    q = linear(qr, w.wq_b, cfg).reshape(b, s, cfg.n_heads, cfg.head_dim)
    return apply_rope(q, angles[:, :, None, :]), qr


def project_kv(x, w: Attention41, cfg: ModelConfig, angles):
    """Window KV: normed, rotated, FP8-rounded over all d dims (rope tail included), block 32."""
    kv = apply_rope(rms_norm(linear(x, w.wkv, cfg), w.kv_norm, cfg.norm_eps), angles)
    return quant.fp8_e4m3_sim(kv, cfg.kv_quant_block) if cfg.kv_quant_sim else kv


def index_queries(qr, w: Indexer41, cfg: ModelConfig, angles):
    b, s, _ = qr.shape
    q = linear(qr, w.wq_b, cfg).reshape(b, s, cfg.index_n_heads, cfg.index_head_dim)
    q = apply_rope(q, angles[:, :, None, :])
    return quant.fp4_e2m1_sim(q, cfg.index_quant_block) if cfg.index_quant_sim else q


def compress_latents(x, w: Compressor41, st: SourceState41, cfg: ModelConfig, ratio: int, start, n_valid):
    """The pre-RoPE latents of the groups a chunk completes: (latent [B,M,d], group j [B,M], done [B,M]) and the
    carried (kv, score) of the open group. x [B,T,D] at positions start[b]+t, the first n_valid[b] real."""
    B, T, _ = x.shape
    dt = jnp.dtype(cfg.compute_dtype)
    if ratio == 1:  # one token per group: a normed bf16 projection, no gate, no state
        latent = per_token(cfg, lambda x: rms_norm(matmul(x, w.wkv.astype(x.dtype), x.dtype), w.norm, cfg.norm_eps), x)
        j = start[:, None] + jnp.arange(T)[None, :]
        return latent, j, jnp.arange(T)[None, :] < n_valid[:, None], None, None
    R = ratio
    hp = jax.lax.Precision.HIGHEST

    def project(xf):
        return (jnp.einsum("bsi,oi->bso", xf, w.wkv.astype(jnp.float32), precision=hp),
                jnp.einsum("bsi,oi->bso", xf, w.wgate.astype(jnp.float32), precision=hp))

    kv, score = per_token(cfg, project, x.astype(jnp.float32))
    buf_pos = start[:, None] - R + jnp.arange(R)[None, :]                     # positions start-R .. start-1
    live = (buf_pos >= 0)[..., None]
    ext_kv = jnp.concatenate([jnp.where(live, take_rows(st.kv, buf_pos % R), 0.0), kv], axis=1)
    ext_sc = jnp.concatenate([jnp.where(live, take_rows(st.score, buf_pos % R), -jnp.inf), score], axis=1)

    def ext_index(p):
        return (p - (start - R).reshape((B,) + (1,) * (p.ndim - 1))).clip(0, R + T - 1)

    M = T // R + 1
    j = start[:, None] // R + jnp.arange(M)[None, :]                              # candidate groups
    done = (j + 1) * R <= (start + n_valid)[:, None]
    members = ext_index(j[..., None] * R + jnp.arange(R))                          # [B,M,R]
    g_kv, g_sc = take_rows(ext_kv, members), take_rows(ext_sc, members)

    def pool(g_kv, g_sc):
        pooled = jnp.sum(materialize(g_kv * softmax_exact(g_sc, axis=2)), axis=2)
        return rms_norm(round_to(pooled, dt), w.norm, cfg.norm_eps)

    latent = per_token(cfg, pool, g_kv, g_sc)
    end = start + n_valid
    slot_pos = (end - R)[:, None] + (jnp.arange(R)[None, :] - (end - R)[:, None]) % R
    return latent, j, done, take_rows(ext_kv, ext_index(slot_pos)), take_rows(ext_sc, ext_index(slot_pos))


def _write(cache, rows, done, values):
    n = cache.shape[1]
    rows = jnp.where(done & (rows < n), rows, n)  # out of range -> dropped
    return jax.vmap(lambda c, r, v: c.at[r].set(v.astype(c.dtype), mode="drop"))(cache, rows, values)


def update_source(x, w: Attention41, st: SourceState41, cfg: ModelConfig, layer: int, start, n_valid) -> SourceState41:
    """A KV source's caches after a chunk: main entries (rope at j·ratio, FP4 e4m3/16) and index keys
    (k_norm(wk(latent)), rope at j·ratio, FP4 ue8m0/32), both from the pre-RoPE latent."""
    ratio = cfg.layer_ratio(layer)
    latent, j, done, kv_buf, sc_buf = compress_latents(x, w.compressor, st, cfg, ratio, start, n_valid)

    def finish(latent, j):
        angles = rope_angles(cfg, layer, j * ratio)
        main = apply_rope(latent, angles)
        if v41_rows.compact(cfg):
            main = v41_rows.quantize_main(main, cfg)  # the rounding below, written as packed codes + scales
        elif cfg.kv_quant_sim:
            main = quant.fp4_e2m1_sim(main, MAIN_KV_BLOCK, scale_format="e4m3")
        k = rms_norm(matmul(latent, w.indexer.wk.astype(latent.dtype), latent.dtype), w.indexer.k_norm, cfg.norm_eps)
        k = apply_rope(k, angles)
        if cfg.index_quant_sim:
            k = quant.fp4_e2m1_sim(k, cfg.index_quant_block)
        return main, v41_rows.store_index(k, cfg)

    main, k = per_token(cfg, finish, latent, j)
    return SourceState41(kv=kv_buf, score=sc_buf, entries=_write(st.entries, j, done, main),
                         index_keys=_write(st.index_keys, j, done, k))


def candidate_blocks(scores, compress_len, topk_blocks: int, block_size: int):
    """The candidate source's first-level top-k (spec §3.8 step 5): bool [..., N] over positions.

    scores [..., N] with unreachable entries at -inf; compress_len [...] entries visible. Block score = max over
    its positions; the block holding the newest visible entry is pinned (+inf); the best `topk_blocks` blocks
    with a score above -inf are kept (ties toward the lower block, as the goldens' stable top-k)."""
    N = scores.shape[-1]
    idx, kept, nb = _top_blocks(scores, compress_len, topk_blocks, block_size)
    ids = jnp.where(kept, idx, nb).reshape(-1, idx.shape[-1])                 # dropped blocks: out of range
    rows = jnp.arange(ids.shape[0])[:, None]   # a scatter: the [k, nb] compare it replaces took 9.8 ms a 128k chunk
    keep = jnp.zeros((ids.shape[0], nb), bool).at[rows, ids].set(True, mode="drop")
    return jnp.repeat(keep.reshape(idx.shape[:-1] + (nb,)), block_size, axis=-1)[..., :N]


def candidate_ids(scores, compress_len, topk_blocks: int, block_size: int):
    """`candidate_blocks` as block ids: (int32 [..., min(topk_blocks, nb)] ascending, kept bool), the kept ones
    first; what a Reindex layer needs to score only its candidates (`layers.reindex`)."""
    idx, kept, nb = _top_blocks(scores, compress_len, topk_blocks, block_size)
    ids = jnp.sort(jnp.where(kept, idx, nb), axis=-1)                         # dropped blocks sort last as nb
    return jnp.minimum(ids, nb - 1).astype(jnp.int32), ids < nb


def _top_blocks(scores, compress_len, topk_blocks: int, block_size: int):
    """(block ids [..., min(topk_blocks, nb)] in top-k order, kept: score above -inf, nb) of `candidate_blocks`."""
    N = scores.shape[-1]
    nb = -(-N // block_size)
    padded = jnp.pad(scores, [(0, 0)] * (scores.ndim - 1) + [(0, nb * block_size - N)], constant_values=-jnp.inf)
    block = jnp.max(padded.reshape(scores.shape[:-1] + (nb, block_size)), axis=-1)
    last = jnp.floor_divide(compress_len - 1, block_size)
    block = jnp.where(jnp.arange(nb) == last[..., None], jnp.inf, block)
    top, idx = jax.lax.top_k(block, min(topk_blocks, nb))
    return idx, top > -jnp.inf, nb


def select_topk(scores, visible, k: int, *, bf16_values: bool = False):
    """Top-k entries per query, ties toward the lower index: (indices int32 [..., k'], valid [..., k']).

    As the reference, a pick is valid when the entry is visible — even at -inf, which happens in a Reindex layer
    whose candidates hold fewer than k visible entries: it then attends to the lowest-index others. bf16_values:
    the scores are bf16 values (`radix_topk.top_k` may then skip the sort, with the same result)."""
    k = min(k, scores.shape[-1])
    _, idx = radix_topk.top_k(jnp.where(visible, scores.astype(jnp.float32), -jnp.inf), k, bf16_values=bf16_values)
    return idx.astype(jnp.int32), jnp.take_along_axis(visible, idx, axis=-1)


def attention41(x, w: Attention41, cfg: ModelConfig, layer: int, st: LayerState41, shared: dict, start, n_valid):
    """One V4.1 attention sub-layer over a chunk. x [B,T,D] (normed) at positions start[b]+t, the first n_valid[b]
    real. `shared` carries what earlier layers of this forward published ("sources": new SourceState41 by layer;
    "topk": the last index source's picks; "candidates"; "index_keys": the reference's index-key pointer;
    optionally "window_from" [B]: window keys before it are not there — the CED replay) and collects "pending": each
    layer's (x, stored window KV).
    Returns (out [B,T,D], new layer state)."""
    B, T, _ = x.shape
    q_pos, angles, q, kv, iq = chunk_projections(x, w, cfg, layer, start, project_q, project_kv, index_queries)
    kv = v41_rows.store_window(kv, cfg)
    shared.setdefault("pending", []).append((x, kv))  # what `commit_layer41` needs to commit a shorter prefix
    window_ok = None            # CED replay: the ring holds nothing before the replayed tokens
    if shared.get("window_from") is not None:
        k_pos = q_pos[..., None] - (cfg.window_size - 1) + jnp.arange(cfg.window_size)
        window_ok = k_pos >= shared["window_from"][:, None, None]                 # [B,T,W], window_keys order
    new = LayerState41(window=update_ring(st.window, kv, start, n_valid), source=st.source)
    ratio = cfg.layer_ratio(layer)
    compressed = bool(ratio) and layer < cfg.n_layers
    if compressed:
        if w.compressor is not None:
            new = LayerState41(window=new.window, source=update_source(x, w, st.source, cfg, layer, start, n_valid))
            shared["sources"][layer] = new.source
            if cfg.reference_index_key_bug:
                _publish_index_keys(shared, new.source, start, n_valid, ratio)
        src = shared["sources"][kv_source_of(cfg, layer)]
        N = src.entries.shape[1]
        visible = compressed_visible(q_pos, N, ratio)                                # [B,T,N]
        if w.indexer is not None and 0 <= cfg.candidate_source_layer < layer and reindex.applies(cfg):
            shared["topk"] = reindex.candidate_picks(      # a Reindex layer scoring its candidates alone
                x, iq, w.indexer, cfg, v41_rows.load_index(_index_keys_for(shared, src, cfg, N), cfg),
                *shared["candidate_ids"], (q_pos + 1) // ratio)
        elif w.indexer is not None:
            scores = chunk_index_scores(x, iq, w.indexer, cfg, _index_keys_for(shared, src, cfg, N),
                                        v41_rows.load_index, (q_pos + 1) // ratio)
            scores = jnp.where(visible, scores, -jnp.inf)
            if layer == cfg.candidate_source_layer:       # the Reindex layers' candidates: as block ids or a mask
                publish, key = (candidate_ids, "candidate_ids") if reindex.applies(cfg) else (candidate_blocks,
                                                                                               "candidates")
                shared[key] = publish(scores, (q_pos + 1) // ratio, cfg.candidate_topk_blocks, cfg.candidate_block_size)
            elif 0 <= cfg.candidate_source_layer < layer:
                scores = jnp.where(shared["candidates"], scores, -jnp.inf)
            shared["topk"] = select_topk(scores, visible, cfg.index_topk,
                                         bf16_values=cfg.scores_are_bf16)
        assert index_source_of(cfg, layer) >= 0, f"layer {layer} has no index source before it"
        chosen, chosen_ok = shared["topk"]
    if T <= 16 and choose(cfg, "sparse_mqa", rows=B * T, chunk=T, dtype=q.dtype, fmt="v41-rows",
                          sharded=active_mesh() is not None, operands=(src.entries,) if compressed else ()) == "pallas":
        src_entries = (src.entries, sparse_mqa.csa_indices(chosen, chosen_ok)) if compressed else (None, None)
        o = kernel_attention(q, w.attn_sink, st.window, kv, src_entries, cfg, start, window_ok)
        return unrotated_output(o, angles, w, cfg), new
    keys, valid = window_keys(st.window, kv, start, cfg.window_size)
    if window_ok is not None:
        valid = valid & window_ok
    keys = v41_rows.load_window(keys, cfg)
    if compressed:
        picked = v41_rows.load_main(take_rows(src.entries, chosen), cfg)
        keys = jnp.concatenate([keys, picked.astype(keys.dtype)], axis=2)
        valid = jnp.concatenate([valid, chosen_ok], axis=2)
    return attend_keys(q, keys, valid, angles, w, cfg), new


def kernel_attention(q, sink, ring, kv_stored, comp, cfg: ModelConfig, start, window_ok=None):
    """Decode / verify attention through the sparse MQA kernel (`dsjax.kernels.sparse_mqa`), reading V4.1's
    compact rows in place: the window as 528-byte FP8 rows (V4's main-row layout with no rope dims, scales per 32),
    the compressed picks as 288-byte FP4 rows (e4m3 scale per 16). comp = (entries, picks int32 [B,T,K]) or
    (None, None); window_ok [B,T,W] (or None) drops window keys (the CED replay's). Returns o [B,T,H,d] before the
    inverse rope: `sink_attention` on the same key list."""
    T = q.shape[1]
    fmts = (MainRowFormat(nope=cfg.head_dim, rope=0, block=v41_rows.WINDOW_BLOCK), Fp4RowFormat.from_config(cfg))
    window = sparse_mqa.window_rows(ring, kv_stored)
    win_idx = sparse_mqa.window_indices(start, T, cfg.window_size)
    if window_ok is not None:
        win_idx = jnp.where(window_ok, win_idx, -1)
    entries, picks = comp
    if not v41_rows.compact(cfg):
        window, entries = window.astype(q.dtype), None if entries is None else entries.astype(q.dtype)
    return sparse_mqa.sparse_mqa_decode(q, sink, window, win_idx, entries, picks, scale=cfg.head_dim ** -0.5,
                                        row_format=fmts, implementation="pallas")


def commit_layer41(x, kv, w: Attention41, cfg: ModelConfig, layer: int, st: LayerState41, start, n_valid) -> LayerState41:
    """The layer state after only the first n_valid[b] tokens of a chunk (x its normed attention input, kv its
    stored window KV): a verify block attends to all its tokens, then commits the accepted ones; rejected
    positions leave no trace in the window ring, the open compressor group, the entries or the index keys."""
    source = st.source
    if source is not None:
        source = update_source(x, w, source, cfg, layer, start, n_valid)
    return LayerState41(window=update_ring(st.window, kv, start, n_valid), source=source)


def _publish_index_keys(shared: dict, source: SourceState41, start, n_valid, ratio: int) -> None:
    """The reference's global `index_k` pointer moves to an owner's key cache only when the owner completes a
    group in this call (spec §1 item 3); rows that complete none keep pointing at the previous publisher's."""
    published = (start + n_valid) // ratio > start // ratio                          # [B]
    prev = shared["index_keys"]
    keys = source.index_keys
    n = max(prev.shape[1], keys.shape[1])
    pad = lambda a: jnp.pad(a, ((0, 0), (0, n - a.shape[1]), (0, 0)))
    shared["index_keys"] = jnp.where(published[:, None, None], pad(keys), pad(prev))


def _index_keys_for(shared: dict, src: SourceState41, cfg: ModelConfig, N: int):
    """Index keys an indexer scores against: its KV source's (fixed), or the reference's pointer (bug switch)."""
    if not cfg.reference_index_key_bug:
        return src.index_keys
    keys = shared["index_keys"]
    return keys[:, :N] if keys.shape[1] >= N else jnp.pad(keys, ((0, 0), (0, N - keys.shape[1]), (0, 0)))
