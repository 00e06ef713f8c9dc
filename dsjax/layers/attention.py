"""V4 attention: low-rank q, one shared 512-d KV latent (K = V), per-head sink, grouped low-rank output.

Every layer attends to a sliding window of raw KV; CSA layers add the indexer's top-k compressed entries,
HCA layers every completed compressed entry. One function serves prefill chunks, decode steps
and verify blocks: each query gathers a fixed-length key list (its window, then its compressed entries) from the
layer state and the chunk, so results do not depend on how a sequence was split into chunks.

Long chunks (training windows, early prefill chunks) take a dense path instead when it is cheaper: every query
scores the same key rows — the ring, the chunk, all compressed entries — under a mask that admits exactly the
keys of its list. Same keys, same probabilities; only the order of the fp32 sums differs, so it is never used
when `cfg.batch_invariant` asks for chunking-independent bits. Per-query gathers would materialise
[B, T, W + k, d] (2 GB a layer for a 32 x 512 training batch); the dense scores are [B, T, H, W + T + N].
"""

import jax
import jax.numpy as jnp

from dsjax import kv_rows, quant
from dsjax.config import ModelConfig
from dsjax.kernel_choice import choose
from dsjax.layers.compressor import compress_chunk
from dsjax.layers.chunk_indexer import chunk_index_scores
from dsjax.layers.indexer import index_queries, select_topk
from dsjax.layers.linear import einsum_acc32, linear
from dsjax.layers.norms import rms_norm, weightless_head_norm
from dsjax.layers.rope import apply_rope, rope_angles
from dsjax.layers.rows import per_token, take_rows
from dsjax.sharding import active_mesh, constrain
from dsjax.state import LayerState
from dsjax.weights import Attention
from dsjax.numerics import div_exact, round_to


def project_q(x, w: Attention, cfg: ModelConfig, angles):
    """x [b,s,D] -> (q [b,s,H,d] normed and rotated, qr [b,s,q_lora] for the indexer)."""
    b, s, _ = x.shape
    qr = rms_norm(linear(x, w.wq_a, cfg), w.q_norm, cfg.norm_eps)
    q = linear(qr, w.wq_b, cfg).reshape(b, s, cfg.n_heads, cfg.head_dim)
    q = weightless_head_norm(q, cfg.norm_eps)
    q = constrain(q, cfg.sharding, ("batch", None, "heads", None))
    return apply_rope(q, angles[:, :, None, :]), qr


def project_kv(x, w: Attention, cfg: ModelConfig, angles):
    """x [b,s,D] -> the shared latent [b,s,d]: normed, rotated, FP8-rounded on the non-rope dims."""
    kv = rms_norm(linear(x, w.wkv, cfg), w.kv_norm, cfg.norm_eps)
    kv = apply_rope(kv, angles)
    if cfg.kv_quant_sim:
        rd = cfg.rope_head_dim
        kv = jnp.concatenate([quant.fp8_e4m3_sim(kv[..., :-rd], cfg.kv_quant_block), kv[..., -rd:]], axis=-1)
    return kv


def sink_attention(q, keys, valid, sink, scale: float):
    """Softmax attention with a per-head zero-value sink, K = V, over per-query key lists.

    q [b,t,H,d]; keys [b,t,K,d] per query, or [b,K,d] shared by all queries; valid [b,t,K]. As the reference kernel: fp32 logits, max over the valid keys,
    probabilities rounded to the compute dtype before P·V, the sink only in the denominator; a query with no
    valid key returns 0. The key list has a fixed length, so the reductions do not depend on the chunking.
    """
    dt = q.dtype
    kspec = "btkd" if keys.ndim == 4 else "bkd"
    logits = einsum_acc32(f"bthd,{kspec}->bthk", q, keys) * scale
    m = valid[:, :, None, :]
    logits = jnp.where(m, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.where(m, jnp.exp(logits - row_max), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True) + jnp.exp(sink[None, None, :, None] - row_max)
    o = einsum_acc32(f"bthk,{kspec}->bthd", round_to(p, dt), keys)
    return round_to(div_exact(o, denom), dt)


def window_keys(ring, kv, start, window: int):
    """Per query, its window as a key list in ascending position order (oldest first).

    ring [B,W,d] holds positions < start (slot p % W); kv [B,T,d] the chunk. Returns keys [B,T,W,d], valid [B,T,W].
    """
    T = kv.shape[1]
    q_pos = start[:, None] + jnp.arange(T)[None, :]                       # [B,T]
    k_pos = q_pos[..., None] - (window - 1) + jnp.arange(window)         # [B,T,W]
    src = jnp.where(k_pos >= start[:, None, None], window + k_pos - start[:, None, None], k_pos % window)
    keys = take_rows(jnp.concatenate([ring, kv], axis=1), src)
    return keys, k_pos >= 0


def dense_window(ring, kv, start, window: int):
    """The window as shared key rows: (keys [B, W+T, d] = ring then chunk, valid [B, T, W+T]).

    Ring slot s holds the latest position p < start with p ≡ s (mod W) — negative when none was written yet;
    a query at q admits exactly the positions q-W < p ≤ q, p ≥ 0: the key list `window_keys` gathers."""
    W, T = ring.shape[1], kv.shape[1]
    q_pos = start[:, None] + jnp.arange(T)[None, :]                                          # [B,T]
    last = start[:, None] - 1
    ring_pos = last - (last - jnp.arange(W)[None, :]) % W                                     # [B,W]
    k_pos = jnp.concatenate([ring_pos, q_pos], axis=1)                                        # [B,W+T]
    valid = (k_pos[:, None, :] <= q_pos[..., None]) & (k_pos[:, None, :] > q_pos[..., None] - window) \
        & (k_pos[:, None, :] >= 0)
    return jnp.concatenate([ring, kv.astype(ring.dtype)], axis=1), valid


def picked_mask(chosen, chosen_ok, n_entries: int):
    """Top-k picks [B,T,k] (+ their validity) as a mask over all entries [B,T,N]."""
    hit = jnp.zeros(chosen.shape[:2] + (n_entries,), jnp.int32)
    hit = jax.vmap(jax.vmap(lambda h, i, ok: h.at[i].max(ok.astype(jnp.int32))))(hit, chosen, chosen_ok)
    return hit > 0


def dense_pays(cfg: ModelConfig, T: int, n_entries: int, ratio: int) -> bool:
    """The dense path for a chunk of T tokens: not token by token, a long chunk, and its shared key rows
    (W + T + N) at most 8x the per-query list (W + k, or W + N in HCA layers)."""
    listed = cfg.window_size + (min(cfg.index_topk, n_entries) if ratio == 4 and cfg.index_topk else n_entries)
    return not cfg.batch_invariant and T >= 64 and cfg.window_size + T + n_entries <= 8 * listed


def update_ring(ring, kv, start, n_valid):
    """Slot s <- the latest real position p < start+n_valid with p ≡ s (mod W): from the chunk or kept."""
    W = ring.shape[1]
    end = start + n_valid
    p = (end - 1)[:, None] - ((end - 1)[:, None] - jnp.arange(W)[None, :]) % W   # [B,W]
    from_chunk = p >= start[:, None]
    src = jnp.where(from_chunk, W + p - start[:, None], jnp.arange(W)[None, :])
    return take_rows(jnp.concatenate([ring, kv.astype(ring.dtype)], axis=1), src)


def compressed_visible(q_pos, n_entries: int, ratio: int):
    """[..., n] entry j is visible to position q once its group is complete: j < (q+1)//ratio."""
    return jnp.arange(n_entries) < ((q_pos + 1) // ratio)[..., None]


def chunk_projections(x, w, cfg: ModelConfig, layer: int, start, project_q, project_kv, index_queries):
    """The opening V4's and V4.1's attention share: the chunk's positions [B,T], rope angles, queries, new KV and
    index queries (None without an indexer), per token where the config asks. The projections are each model's."""
    T = x.shape[1]
    q_pos = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    angles = rope_angles(cfg, layer, q_pos)

    def projections(x, angles):
        q, qr = project_q(x, w, cfg, angles)
        iq = index_queries(qr, w.indexer, cfg, angles) if w.indexer is not None else None
        return q, project_kv(x, w, cfg, angles), iq

    q, kv, iq = per_token(cfg, projections, x, angles)
    return q_pos, angles, q, kv, iq


def unrotated_output(o, angles, w, cfg: ModelConfig):
    """Attention output o [B,T,H,d] with the rope taken back off its rope dims, through the output projection."""
    return output_projection(apply_rope(o, angles[:, :, None, :], inverse=True), w, cfg)


def attend_keys(q, keys, valid, angles, w, cfg: ModelConfig):
    """Sink attention of q [B,T,H,d] over each query's gathered keys [B,T,K,d] (valid [B,T,K]), then the output
    projection; per token where the config asks (one rounding order for any batch)."""
    def attend(q, keys, valid, angles):
        return unrotated_output(sink_attention(q, keys, valid, w.attn_sink, cfg.head_dim ** -0.5), angles, w, cfg)

    return per_token(cfg, attend, q, keys, valid, angles)


def output_projection(o, w: Attention, cfg: ModelConfig):
    """Grouped low-rank output: o [b,s,H,d] -> per-group wo_a (bf16 einsum) -> wo_b."""
    b, s = o.shape[:2]
    G, R = cfg.o_groups, cfg.o_lora_rank
    og = constrain(o.reshape(b, s, G, -1), cfg.sharding, ("batch", None, "heads", None))
    wo_a = w.wo_a.astype(o.dtype).reshape(G, R, -1)
    r = einsum_acc32("bsgd,grd->bsgr", og, wo_a)
    return linear(round_to(r, o.dtype).reshape(b, s, G * R), w.wo_b, cfg)


def commit_layer(x, kv_stored, w: Attention, cfg: ModelConfig, layer: int, st: LayerState, start, n_valid) -> LayerState:
    """The layer state after the first n_valid[b] tokens of a chunk: window ring, compressor groups, entries.

    A pure function of the old state and the chunk's inputs, so a verify block can attend to all its tokens and
    then commit only the accepted ones: rejected positions leave no trace.
    """
    ratio = cfg.layer_ratio(layer)
    comp = index = None
    if ratio:
        comp = compress_chunk(x, w.compressor, st.compressor, cfg, layer, ratio, start, n_valid)
        if w.indexer is not None:
            index = compress_chunk(x, w.indexer.compressor, st.index, cfg, layer, ratio, start, n_valid, index_keys=True)
    return LayerState(window=update_ring(st.window, kv_stored, start, n_valid), compressor=comp, index=index)


def attention(x, w: Attention, cfg: ModelConfig, layer: int, st: LayerState, start, n_valid):
    """One attention sub-layer over a chunk. x [B,T,D] (normed) at positions start[b]+t, the first n_valid[b]
    real; st holds everything before `start`. Returns (out [B,T,D], new layer state, (x, stored kv)) — the
    last being what `commit_layer` needs to commit a shorter prefix of the chunk later."""
    B, T, _ = x.shape
    q_pos, angles, q, kv, iq = chunk_projections(x, w, cfg, layer, start, project_q, project_kv, index_queries)
    kv_stored = kv_rows.store_main(kv, cfg)
    new = commit_layer(x, kv_stored, w, cfg, layer, st, start, n_valid)
    ratio = cfg.layer_ratio(layer)
    sharded = active_mesh() is not None
    op = "chunk_attention" if T > 16 else "sparse_mqa"          # prefill chunks vs decode / verify blocks
    caches = (new.compressor.entries, new.index.entries if w.indexer is not None else st.window) if ratio else ()
    n_entries = new.compressor.entries.shape[1] if ratio else 0
    shared = n_entries if w.indexer is None else 0                  # HCA: every query may see all entries
    if choose(cfg, op, rows=B * T, chunk=T, dtype=q.dtype, sharded=sharded, operands=caches,
              entries=shared) == "pallas":
        from dsjax.layers import sparse_attention as kernel_path
        visible = compressed_visible(q_pos, n_entries, ratio) if ratio else None
        chosen = None
        if ratio and w.indexer is not None:
            chosen = kernel_path.pick_entries(x, iq, w.indexer, cfg, new.index.entries, q_pos, ratio, visible)
        attend = kernel_path.chunk_attention if op == "chunk_attention" else kernel_path.sparse_attention
        o = attend(q, w.attn_sink, st.window, kv_stored, new.compressor, chosen, cfg, ratio, start)
        return unrotated_output(o, angles, w, cfg), new, (x, kv_stored)
    dense = dense_pays(cfg, T, n_entries, ratio)
    keys, valid = (dense_window if dense else window_keys)(st.window, kv_stored, start, cfg.window_size)
    keys = kv_rows.load_main(keys, cfg)
    if ratio:
        comp = new.compressor
        visible = compressed_visible(q_pos, n_entries, ratio)                       # [B,T,N]
        c_valid = visible
        if w.indexer is not None:
            scores = chunk_index_scores(x, iq, w.indexer, cfg, new.index.entries, kv_rows.load_index,
                                        (q_pos + 1) // ratio)
            chosen, chosen_ok = select_topk(scores, visible, cfg.index_topk,
                                            bf16_values=cfg.scores_are_bf16)
            c_valid = picked_mask(chosen, chosen_ok, n_entries) if dense else chosen_ok
        if dense:
            c_keys = kv_rows.load_main(comp.entries, cfg)                          # [B,N,d] shared
        elif w.indexer is not None:
            c_keys = kv_rows.load_main(take_rows(comp.entries, chosen), cfg)
        else:
            entries = kv_rows.load_main(comp.entries, cfg)
            c_keys = jnp.broadcast_to(entries[:, None], (B, T) + entries.shape[1:])
        keys = jnp.concatenate([keys, c_keys.astype(keys.dtype)], axis=keys.ndim - 2)
        valid = jnp.concatenate([valid, c_valid], axis=2)
    return attend_keys(q, keys, valid, angles, w, cfg), new, (x, kv_stored)
