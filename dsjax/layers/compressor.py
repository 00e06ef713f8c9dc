"""The KV compressor: gated softmax pooling of `ratio` consecutive tokens into one entry.

Entry j covers tokens [j·ratio, (j+1)·ratio). Ratio 4 ("overlap") pools 8 tokens: the A-half channels of
group j−1 and the B-half channels of group j. The pooled entry is normed, rotated at position j·ratio, and
fake-quantised like the cache it lives in: FP8 on the non-rope dims for main KV, Hadamard + FP4 for index keys.
"""

import jax
import jax.numpy as jnp

from dsjax import quant
from dsjax.config import ModelConfig
from dsjax.layers.norms import rms_norm
from dsjax.layers.rope import apply_rope, rope_angles
from dsjax.weights import Compressor
from dsjax.numerics import materialize, round_to, softmax_exact


def pool_groups(kv, score, ratio: int, overlap: bool):
    """kv, score: fp32 [b, n, ratio, c·d] (ape already in score) -> pooled fp32 [b, n, d]."""
    if overlap:
        d = kv.shape[-1] // 2
        pad_kv = jnp.zeros_like(kv[:, :1, :, :d])
        pad_sc = jnp.full_like(score[:, :1, :, :d], -jnp.inf)
        prev_kv = jnp.concatenate([pad_kv, kv[:, :-1, :, :d]], axis=1)
        prev_sc = jnp.concatenate([pad_sc, score[:, :-1, :, :d]], axis=1)
        kv = jnp.concatenate([prev_kv, kv[..., d:]], axis=2)
        score = jnp.concatenate([prev_sc, score[..., d:]], axis=2)
    return jnp.sum(materialize(kv * softmax_exact(score, axis=2)), axis=2)


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


def compress_prefill(x, w: Compressor, cfg: ModelConfig, layer: int, ratio: int, *, index_keys: bool = False):
    """All complete groups of a sequence that starts at position 0. x [b, s, D] -> entries [b, s//ratio, d]."""
    b, s, _ = x.shape
    n = s // ratio
    xf = x.astype(jnp.float32)
    hp = jax.lax.Precision.HIGHEST
    kv = jnp.einsum("bsi,oi->bso", xf[:, : n * ratio], w.wkv.astype(jnp.float32), precision=hp)
    score = jnp.einsum("bsi,oi->bso", xf[:, : n * ratio], w.wgate.astype(jnp.float32), precision=hp)
    kv = kv.reshape(b, n, ratio, kv.shape[-1])  # explicit width: n is 0 while s < ratio
    score = score.reshape(b, n, ratio, score.shape[-1]) + w.ape
    pooled = pool_groups(kv, score, ratio, overlap=ratio == 4)
    positions = jnp.arange(n, dtype=jnp.int32) * ratio
    return finish_entries(pooled, positions[None, :], w, cfg, layer, index_keys=index_keys, dtype=x.dtype)
