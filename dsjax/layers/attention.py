"""V4 attention: low-rank q, one shared 512-d KV latent (K = V), per-head sink, grouped low-rank output.

Every layer attends to a sliding window of raw KV; CSA layers add the indexer's top-k compressed entries,
HCA layers every completed compressed entry. This module holds the full-sequence (prefill from position 0)
form with dense visibility masks; the sparse-gather decode form lives beside the decode state.
"""

import jax
import jax.numpy as jnp

from dsjax import quant
from dsjax.config import ModelConfig
from dsjax.layers.compressor import compress_prefill
from dsjax.layers.indexer import index_queries, index_scores, select_topk
from dsjax.layers.linear import einsum_acc32, linear
from dsjax.layers.norms import rms_norm, weightless_head_norm
from dsjax.layers.rope import apply_rope, rope_angles
from dsjax.weights import Attention
from dsjax.numerics import div_exact, round_to


def project_q(x, w: Attention, cfg: ModelConfig, angles):
    """x [b,s,D] -> (q [b,s,H,d] normed and rotated, qr [b,s,q_lora] for the indexer)."""
    b, s, _ = x.shape
    qr = rms_norm(linear(x, w.wq_a, cfg), w.q_norm, cfg.norm_eps)
    q = linear(qr, w.wq_b, cfg).reshape(b, s, cfg.n_heads, cfg.head_dim)
    q = weightless_head_norm(q, cfg.norm_eps)
    return apply_rope(q, angles[:, :, None, :]), qr


def project_kv(x, w: Attention, cfg: ModelConfig, angles):
    """x [b,s,D] -> the shared latent [b,s,d]: normed, rotated, FP8-rounded on the non-rope dims."""
    kv = rms_norm(linear(x, w.wkv, cfg), w.kv_norm, cfg.norm_eps)
    kv = apply_rope(kv, angles)
    if cfg.kv_quant_sim:
        rd = cfg.rope_head_dim
        kv = jnp.concatenate([quant.fp8_e4m3_sim(kv[..., :-rd], cfg.kv_quant_block), kv[..., -rd:]], axis=-1)
    return kv


def sink_attention(q, kv, mask, sink, scale: float):
    """Softmax attention with a per-head zero-value sink, K = V. q [b,s,H,d], kv [b,T,d], mask [b,s,T].

    As the reference kernel: fp32 logits, max over the visible set, probabilities rounded to the compute
    dtype before P·V, the sink only in the denominator. A row with nothing visible returns 0.
    """
    dt = q.dtype
    logits = einsum_acc32("bshd,btd->bhst", q, kv) * scale
    m4 = mask[:, None]
    logits = jnp.where(m4, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.where(m4, jnp.exp(logits - row_max), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True) + jnp.exp(sink[None, :, None, None] - row_max)
    o = einsum_acc32("bhst,btd->bshd", round_to(p, dt), kv)
    return round_to(div_exact(o, jnp.moveaxis(denom, 1, 2)), dt)


def window_mask(s: int, window: int):
    """[s, s] causal sliding window: query i sees keys max(0, i-window+1)..i."""
    i = jnp.arange(s)[:, None]
    j = jnp.arange(s)[None, :]
    return (j <= i) & (j > i - window)


def compressed_visible(s: int, n_entries: int, ratio: int):
    """[s, n] entry j is visible to position i once its group is complete: j < (i+1)//ratio."""
    return jnp.arange(n_entries)[None, :] < (jnp.arange(s)[:, None] + 1) // ratio


def output_projection(o, w: Attention, cfg: ModelConfig):
    """Grouped low-rank output: o [b,s,H,d] -> per-group wo_a (bf16 einsum) -> wo_b."""
    b, s = o.shape[:2]
    G, R = cfg.o_groups, cfg.o_lora_rank
    og = o.reshape(b, s, G, -1)
    wo_a = w.wo_a.astype(o.dtype).reshape(G, R, -1)
    r = einsum_acc32("bsgd,grd->bsgr", og, wo_a)
    return linear(round_to(r, o.dtype).reshape(b, s, G * R), w.wo_b, cfg)


def attention_prefill(x, w: Attention, cfg: ModelConfig, layer: int):
    """Full-sequence attention from position 0. x [b,s,D] (normed sub-layer input) -> [b,s,D]."""
    b, s, _ = x.shape
    positions = jnp.arange(s, dtype=jnp.int32)[None, :]
    angles = rope_angles(cfg, layer, positions)
    q, qr = project_q(x, w, cfg, angles)
    kv = project_kv(x, w, cfg, angles)
    mask = jnp.broadcast_to(window_mask(s, cfg.window_size), (b, s, s))
    ratio = cfg.layer_ratio(layer)
    if ratio:
        entries = compress_prefill(x, w.compressor, cfg, layer, ratio)
        visible = jnp.broadcast_to(compressed_visible(s, entries.shape[1], ratio), (b, s, entries.shape[1]))
        if w.indexer is not None:
            keys = compress_prefill(x, w.indexer.compressor, cfg, layer, ratio, index_keys=True)
            iq = index_queries(qr, w.indexer, cfg, angles)
            visible = select_topk(index_scores(x, iq, keys, w.indexer, cfg), visible, cfg.index_topk)
        kv = jnp.concatenate([kv, entries], axis=1)
        mask = jnp.concatenate([mask, visible], axis=2)
    o = sink_attention(q, kv, mask, w.attn_sink, cfg.head_dim ** -0.5)
    o = apply_rope(o, angles[:, :, None, :], inverse=True)
    return output_projection(o, w, cfg)
