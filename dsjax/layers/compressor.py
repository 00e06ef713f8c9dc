"""The KV compressor: gated softmax pooling of `ratio` consecutive tokens into one entry.

Entry j covers tokens [j·ratio, (j+1)·ratio). Ratio 4 ("overlap") pools 8 tokens: the A-half channels of
group j−1 and the B-half channels of group j. The pooled entry is normed, rotated at position j·ratio, and
fake-quantised like the cache it lives in: FP8 on the non-rope dims for main KV, Hadamard + FP4 for index keys.
"""

import jax
import jax.numpy as jnp

from dsjax import kv_rows, quant
from dsjax.config import ModelConfig
from dsjax.layers.norms import rms_norm
from dsjax.layers.rope import apply_rope, rope_angles
from dsjax.layers.rows import per_token, take_rows
from dsjax.state import CompressorState
from dsjax.weights import Compressor
from dsjax.numerics import materialize, round_to, softmax_exact


def finish_entries(pooled, entry_positions, w: Compressor, cfg: ModelConfig, layer: int, *, index_keys: bool, dtype):
    """Norm, rope at each entry's first-token position, and the cache's fake quantisation."""
    kv = rms_norm(round_to(pooled, dtype), w.norm, cfg.norm_eps)
    kv = apply_rope(kv, rope_angles(cfg, layer, entry_positions))
    if index_keys:
        if cfg.index_quant_sim:
            kv = quant.fp4_e2m1_sim(quant.hadamard(kv), cfg.index_quant_block)
    elif cfg.kv_quant_sim:
        rd = cfg.rope_head_dim
        kv = jnp.concatenate([quant.fp8_e4m3_sim(kv[..., :-rd], cfg.kv_quant_block), kv[..., -rd:]], axis=-1)
    return kv


def compress_chunk(x, w: Compressor, st: CompressorState, cfg: ModelConfig, layer: int, ratio: int,
                   start, n_valid, *, index_keys: bool = False) -> CompressorState:
    """Advance a compressor over a chunk: x [B,T,D] at positions start[b]+t, the first n_valid[b] real.

    Every group that completes inside the chunk is pooled and written to `entries` at its index; the last
    c·ratio positions' projections are kept for the groups still open. Fixed shapes: at most T//ratio + 1
    groups can complete in a chunk, so that many candidates are pooled and the incomplete ones dropped.
    """
    B, T, _ = x.shape
    overlap = ratio == 4
    R = st.kv.shape[1]
    d = st.kv.shape[-1] // (2 if overlap else 1)
    xf = x.astype(jnp.float32)
    hp = jax.lax.Precision.HIGHEST
    pos = start[:, None] + jnp.arange(T)[None, :]                                   # [B,T]
    def project(xf):
        return (jnp.einsum("bsi,oi->bso", xf, w.wkv.astype(jnp.float32), precision=hp),
                jnp.einsum("bsi,oi->bso", xf, w.wgate.astype(jnp.float32), precision=hp))

    kv, score = per_token(cfg, project, xf)
    score = score + w.ape[pos % ratio]
    # the chunk preceded by the buffered positions start-R .. start-1 (slot p % R; nothing before position 0)
    buf_pos = start[:, None] - R + jnp.arange(R)[None, :]
    buf_kv = take_rows(st.kv, buf_pos % R)
    buf_sc = jnp.where((buf_pos >= 0)[..., None], take_rows(st.score, buf_pos % R), -jnp.inf)
    ext_kv = jnp.concatenate([jnp.where((buf_pos >= 0)[..., None], buf_kv, 0.0), kv], axis=1)  # [B, R+T, c·d]
    ext_sc = jnp.concatenate([buf_sc, score], axis=1)

    def ext_index(p):
        return p - (start - R).reshape((B,) + (1,) * (p.ndim - 1))

    # candidate groups j = start//ratio + m, complete when (j+1)·ratio <= start + n_valid
    M = T // ratio + 1
    j = start[:, None] // ratio + jnp.arange(M)[None, :]                            # [B,M]
    done = (j + 1) * ratio <= (start + n_valid)[:, None]
    cur = j[..., None] * ratio + jnp.arange(ratio)                                  # [B,M,ratio] positions
    g_kv = take_rows(ext_kv, ext_index(cur).clip(0, R + T - 1))
    g_sc = take_rows(ext_sc, ext_index(cur).clip(0, R + T - 1))
    if overlap:
        prev = cur - ratio
        p_kv = take_rows(ext_kv, ext_index(prev).clip(0, R + T - 1))[..., :d]
        p_sc = take_rows(ext_sc, ext_index(prev).clip(0, R + T - 1))[..., :d]
        g_kv = jnp.concatenate([p_kv, g_kv[..., d:]], axis=2)
        g_sc = jnp.concatenate([p_sc, g_sc[..., d:]], axis=2)

    def pool(g_kv, g_sc, first):
        pooled = jnp.sum(materialize(g_kv * softmax_exact(g_sc, axis=2)), axis=2)
        return finish_entries(pooled, first, w, cfg, layer, index_keys=index_keys, dtype=jnp.dtype(cfg.compute_dtype))

    new = per_token(cfg, pool, g_kv, g_sc, j * ratio)                                 # [B,M,d]
    new = kv_rows.store_index(new, cfg) if index_keys else kv_rows.store_main(new, cfg)
    n_max = st.entries.shape[1]
    rows = jnp.where(done & (j < n_max), j, n_max)  # out of range -> dropped
    entries = jax.vmap(lambda e, r, v: e.at[r].set(v, mode="drop"))(st.entries, rows, new)
    # keep the last R real positions: slot s <- position end-R+((s-(end-R)) mod R)
    end = start + n_valid
    slot_pos = (end - R)[:, None] + (jnp.arange(R)[None, :] - (end - R)[:, None]) % R
    keep = ext_index(slot_pos)
    return CompressorState(kv=take_rows(ext_kv, keep), score=take_rows(ext_sc, keep), entries=entries)
