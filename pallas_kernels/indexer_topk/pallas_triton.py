"""Lightning-indexer scoring lowered through Triton: one program per (query row, tile of `block_n` index keys).

A program loads its tile of stored keys (68-byte FP4 rows: nibbles decoded in registers as even / odd column
pieces per 32-dim scale block, the ue8m0 scale applied to each block's product; or bf16 values), computes the
[heads, keys] products with `tl.dot` (fp32 accumulation), then the model's roundings: the dot rounded to the
compute dtype, ReLU, times the head weight, rounded, summed over heads in fp32, rounded. Tiles wholly past the
query's visible entries read nothing and write -inf. The top-k runs afterwards in XLA (`xla.topk_lower_index`).
"""


import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dsjax.kernels.common import (check_offsets, dot_nt, dot_tile, e8m0_to_f32, fp4_pieces, gather, iota, pad_axis,
                                  round_bf, row_width, triton_interpret, triton_params)
from dsjax.kernels.indexer_topk.xla import topk_lower_index


def _key_pieces(k_ref, b, rows, fmt, dh: int, dtype):
    """(q columns, key values [bn, w], per-row scale or None) for a tile of stored index keys."""
    r2 = rows[:, None]
    if k_ref.dtype != jnp.uint8:
        w = min(64, dh)
        return [(iota(w) + c, gather(k_ref, b, r2, (iota(w) + c)[None, :]).astype(dtype), None)
                for c in range(0, dh, w)]
    out, hb = [], fmt.block // 2
    for blk in range(dh // fmt.block):
        j = iota(hb) + blk * hb
        scale = e8m0_to_f32(gather(k_ref, b, rows, dh // 2 + blk))
        out += fp4_pieces(gather(k_ref, b, r2, j[None, :]), j, scale, dtype)
    return out


def index_scores(q, weights, keys, n_visible, row_format, *, block_n: int = 128, num_warps: int = 4,
                 num_stages: int = 2, interpret=None):
    """q [B,Q,nh,dh], weights [B,Q,nh], keys [B,N,R], n_visible int32 [B,Q] -> fp32 scores [B,Q,N]
    (compute-dtype values; -inf in tiles past n_visible)."""
    B, Q, nh, dh = q.shape
    N = keys.shape[1]
    assert row_width(keys, row_format) == dh, (keys.shape, row_format, dh)
    hp = dot_tile(nh)
    keys = pad_axis(keys, 1, block_n, 0)
    n_tiles = keys.shape[1] // block_n
    dt = q.dtype
    q2 = pad_axis(q.reshape(B * Q, nh, dh), 1, hp, 0)
    w2 = pad_axis(weights.reshape(B * Q, nh).astype(jnp.float32), 1, hp, 0)   # padded heads weigh 0
    nv = n_visible.reshape(B * Q).astype(jnp.int32)

    def body(q_ref, w_ref, nv_ref, k_ref, out_ref):
        r, t = pl.program_id(0), pl.program_id(1)
        cols_out = pl.ds(t * block_n, block_n)

        @pl.when(t * block_n < nv_ref[r])
        def _score():
            rows = iota(block_n, t * block_n)
            heads = iota(hp)[:, None]
            s = None
            for cols, vals, scale in _key_pieces(k_ref, r // Q, rows, row_format, dh, dt):
                part = dot_nt(gather(q_ref, r, heads, cols[None, :]), vals)            # [hp, bn]
                part = part if scale is None else part * scale[None, :]
                s = part if s is None else s + part
            w = w_ref[r, :]
            s = round_bf(jnp.maximum(round_bf(s, dt), 0.0) * w[:, None], dt)
            out_ref[r, cols_out] = round_bf(jnp.sum(s, axis=0), dt)

        @pl.when(t * block_n >= nv_ref[r])
        def _skip():
            out_ref[r, cols_out] = jnp.full((block_n,), -jnp.inf, jnp.float32)

    check_offsets("indexer_topk", q2, w2, nv, keys)
    scores = pl.pallas_call(
        body, out_shape=jax.ShapeDtypeStruct((B * Q, n_tiles * block_n), jnp.float32), grid=(B * Q, n_tiles),
        compiler_params=triton_params(num_warps, num_stages), interpret=triton_interpret(interpret),
        name="indexer_scores",
    )(q2, w2, nv, keys)
    return scores.reshape(B, Q, -1)[..., :N]


def indexer_topk(q, weights, keys, n_visible, k: int, *, row_format, block_n: int = 128, tile: int = 4096,
                 **options):
    scores = index_scores(q, weights, keys, n_visible, row_format, block_n=block_n, **options)
    return topk_lower_index(scores, n_visible, k, tile)
