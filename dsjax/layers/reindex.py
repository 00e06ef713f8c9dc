"""V4.1 Reindex layers scoring only their candidates (`cfg.reindex_scope == "candidates"`).

A Reindex layer (spec §3.8 step 6) scores every key of its source and sets the non-candidates to -inf before its
top-k, so only the candidate positions — the candidate source's top `candidate_topk_blocks` blocks of
`candidate_block_size` entries, 16,384 positions for V4.1-Flash — can be picked with a finite score. This scores
just those: each query's candidate keys are gathered (in ascending position order), scored with the indexer's
roundings, and the top-k is taken over them. The picks are the same:
- the finite picks are the same entries with the same scores (each head's dot of FP4-quantised q and keys is exact
  in fp32, so a key's score does not depend on which keys are scored beside it), in the same order (ties to the
  lower position: the candidates are ascending);
- the full path's remaining picks are -inf entries of the lowest indices. Those are never visible when
  (candidate_topk_blocks - 1) · candidate_block_size + 1 >= index_topk (V4.1-Flash: 16,377 >= 512; `applies`
  checks it): with more visible blocks than are kept, the kept ones hold that many visible entries, and with fewer,
  every visible entry is a candidate. So they are invalid picks on both paths; only their (unused) indices differ.
Work: the keys a query scores fall from the whole cache (N, up to 1M at ratio 1) to the candidates; the gathered
keys are [B, T, candidates, dh], made in query blocks of at most `GATHER_BYTES`.
"""

import jax
import jax.numpy as jnp

from dsjax.config import ModelConfig
from dsjax.layers import radix_topk
from dsjax.layers.blocked import map_in_blocks
from dsjax.layers.indexer import index_weights, weighted_head_sum
from dsjax.layers.linear import einsum_acc32

GATHER_BYTES = 2 << 30


def applies(cfg: ModelConfig) -> bool:
    """Whether this path gives the full path's picks for cfg (see the module docstring; batch-invariant numerics
    keep the full path, whose token-by-token form they are defined by)."""
    return (cfg.reindex_scope == "candidates" and cfg.index_quant_sim and not cfg.batch_invariant
            and cfg.candidate_source_layer >= 0
            and (cfg.candidate_topk_blocks - 1) * cfg.candidate_block_size + 1 >= cfg.index_topk)


def candidate_picks(x, iq, w, cfg: ModelConfig, keys, ids, kept, n_visible):
    """A Reindex layer's top-k (indices int32 [B,T,k'], valid [B,T,k']), k' = min(index_topk, N), as `select_topk`
    over the candidate-masked scores gives them. x [B,T,D], iq [B,T,nh,dh], keys [B,N,dh] the source's index keys
    as values, ids / kept [B,T,nbk] the candidate blocks (`csa2.candidate_ids`), n_visible int32 [B,T]."""
    B, T = x.shape[:2]
    N = keys.shape[1]
    bs = cfg.candidate_block_size
    k = min(cfg.index_topk, N)
    pos = (ids[..., None] * bs + jnp.arange(bs, dtype=jnp.int32)).reshape(B, T, -1)      # ascending
    live = jnp.repeat(kept, bs, axis=-1) & (pos < n_visible[..., None])
    weights = index_weights(x, w, cfg)
    dt = x.dtype

    def scores_of(q, wts, p):                        # one block of queries: [B, t, nh, dh] ... -> [B, t, P]
        gathered = jax.vmap(lambda kb, pb: kb[jnp.minimum(pb, N - 1)])(keys, p)          # [B, t, P, dh]
        return weighted_head_sum(einsum_acc32("bshd,bspd->bshp", q, gathered.astype(q.dtype)), wts, dt)

    per_query = pos.shape[-1] * keys.shape[-1] * jnp.dtype(dt).itemsize * B
    scores = map_in_blocks(scores_of, (iq, weights, pos), axis=1, block=max(1, GATHER_BYTES // max(per_query, 1)),
                           out_axis=1)
    masked = jnp.where(live, scores.astype(jnp.float32), -jnp.inf)
    _, j = radix_topk.top_k(masked, k, bf16_values=jnp.dtype(dt) == jnp.bfloat16)
    return jnp.take_along_axis(pos, j, axis=-1), jnp.take_along_axis(live, j, axis=-1)
