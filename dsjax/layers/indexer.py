"""The lightning indexer (V4 CSA layers): scores compressed entries per query and keeps the top-k.

score[t] = Σ_h relu(q_h · K[t]) · w_h, with q from the attention's q latent (rope, Hadamard, FP4) and K the
index-key cache built by the indexer's own ratio-4 compressor. Each intermediate is rounded to the compute
dtype where the reference rounds it (bf16 einsum, bf16 weights, bf16 head sum), so selections — and their
ties, broken toward the lower index as `lax.top_k` does — follow the reference.
"""

import jax.numpy as jnp

from dsjax import quant
from dsjax.config import ModelConfig
from dsjax.layers import radix_topk
from dsjax.layers.blocked import map_in_blocks
from dsjax.layers.linear import einsum_acc32, linear, matmul
from dsjax.layers.rope import apply_rope
from dsjax.weights import Indexer
from dsjax.numerics import round_to


def index_queries(qr, w: Indexer, cfg: ModelConfig, angles):
    """qr [b,s,q_lora] -> fake-quantised index queries [b,s,nh,dh]."""
    b, s, _ = qr.shape
    q = linear(qr, w.wq_b, cfg).reshape(b, s, cfg.index_n_heads, cfg.index_head_dim)
    q = apply_rope(q, angles[:, :, None, :])
    if cfg.index_quant_sim:
        q = quant.fp4_e2m1_sim(quant.hadamard(q), cfg.index_quant_block)
    return q


def index_weights(x, w: Indexer, cfg: ModelConfig):
    """x [b,s,D] -> the per-head weights [b,s,nh] in the compute dtype (scaled by dh^-½ · nh^-½, rounded)."""
    dt = x.dtype
    scale = cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5
    return round_to(matmul(x, w.weights_proj.astype(dt), dt).astype(jnp.float32) * scale, dt)


# The per-head products [b, s, nh, T] are the largest array of a prefill chunk at long context (1,024 queries x
# 32 heads x 1M keys in bf16 = 64 GiB). Above this many bytes the keys are scored in blocks of the size that keeps
# them below it, so any prompt length runs in bounded memory (issue 9). Below it (every size measured so far: a
# 128k prompt's chunk is 8 GiB) the one-shot form stays.
PRODUCTS_BYTES = 16 << 30


def index_scores(x, q, keys, w: Indexer, cfg: ModelConfig, *, max_products_bytes: int | None = None):
    """x [b,s,D], q [b,s,nh,dh], keys [b,T,dh] (the index-key cache) -> scores [b,s,T] in the compute dtype.
    Each key's score is the same computation however the keys are blocked (`key_block_scores`)."""
    weights = index_weights(x, w, cfg)
    b, s, nh, _ = q.shape
    limit = PRODUCTS_BYTES if max_products_bytes is None else max_products_bytes
    per_key = b * s * nh * jnp.dtype(x.dtype).itemsize
    return map_in_blocks(lambda k: key_block_scores(q, k, weights, x.dtype), (keys,), axis=1,
                         block=max(1, limit // per_key), out_axis=2)


def key_block_scores(q, keys, weights, dt):
    """The scores of q [b,s,nh,dh] against keys [b,t,dh] with head weights [b,s,nh]: Σ_h relu(q_h · k) · w_h, each
    step rounded to dt where the reference rounds it."""
    return weighted_head_sum(einsum_acc32("bshd,btd->bsht", q, keys), weights, dt)


def weighted_head_sum(products, weights, dt):
    """fp32 per-head products [b,s,nh,t] -> scores [b,s,t]: Σ_h relu(p_h) · w_h with the reference's roundings."""
    s = round_to(products, dt)
    s = round_to(jnp.maximum(s, 0).astype(jnp.float32) * weights[..., None].astype(jnp.float32), dt)
    return round_to(jnp.sum(s.astype(jnp.float32), axis=2), dt)


def select_topk(scores, visible, k: int, *, bf16_values: bool = False):
    """Top-k visible entries per query: (indices int32 [b,s,k'], valid [b,s,k']), k' = min(k, T).

    Ties break toward the lower index (`lax.top_k`), as DeepSeek's goldens assume; picks beyond the visible
    entries come back marked invalid. bf16_values: the scores are bf16 values (`radix_topk.top_k` may then skip
    the sort, with the same result).
    """
    k = min(k, scores.shape[-1])
    masked = jnp.where(visible, scores.astype(jnp.float32), -jnp.inf)
    top, idx = radix_topk.top_k(masked, k, bf16_values=bf16_values)
    return idx.astype(jnp.int32), jnp.isfinite(top)
