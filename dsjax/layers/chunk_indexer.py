"""The lightning indexer's scores for a prefill chunk: the Mosaic GPU scoring kernel (several query rows a
program, each index-key tile read once for them, the ReLU-weighted head sum fused) where `dsjax.kernel_choice`
picks it, else the model's XLA `index_scores`. The same roundings either way. The dots of FP4-quantised queries
and keys are exact in fp32 in any order; the head sum adds bf16 terms in fp32 in the kernel's order, which can move
the final bf16 rounding by one ulp (H200: max |diff| 3e-6 / 3e-4 of the largest score at 32 / 64 heads).
"""

import jax.numpy as jnp

from dsjax.kernel_choice import choose
from dsjax.kernels.common import IndexRowFormat
from dsjax.kernels.indexer_topk import index_scores as index_scores_op
from dsjax.layers.indexer import index_scores, index_weights
from dsjax.layers.rows import per_token
from dsjax.sharding import active_mesh

# Chunks of at least this many tokens may take the kernel here; decode and verify steps keep XLA on this path
# (their kernel is `sparse_attention.pick_entries`, scoring and top-k together).
KERNEL_CHUNK = 64


def chunk_index_scores(x, iq, w, cfg, stored, load, n_visible):
    """Index scores fp32 [B, T, N] of a chunk: x [B,T,D] the attention input, iq [B,T,nh,dh] the index queries,
    w the layer's indexer weights, stored [B,N,R] the index-key cache as stored, load its decoder to compute-dtype
    values (`kv_rows.load_index` / `v41_rows.load_index`), n_visible int32 [B,T] the entries each query sees.
    Entries past a query's n_visible are undefined: the caller masks them."""
    B, T = x.shape[:2]
    # the keys as values, decoded once on either path: the kernel decoding FP4 rows itself would do it once a
    # program, 1,024 / rows_per_program times a tile per chunk (H200: 2.0-2.2x XLA that way, 4.6-5.2x on values)
    keys = load(stored, cfg)
    if T >= KERNEL_CHUNK and choose(cfg, "indexer_topk", rows=B * T, chunk=T, dtype=x.dtype, operands=(stored,),
                                    sharded=active_mesh() is not None) == "pallas":   # GSPMD cannot split a kernel
        return index_scores_op(iq, index_weights(x, w, cfg), keys.astype(x.dtype), n_visible,
                               row_format=IndexRowFormat.from_config(cfg), implementation="pallas")
    return per_token(cfg, lambda x, iq: index_scores(x, iq, keys, w, cfg), x, iq).astype(jnp.float32)
