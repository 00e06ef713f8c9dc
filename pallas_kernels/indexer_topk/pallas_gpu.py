"""Mosaic GPU (`plgpu.kernel`) lightning-indexer scoring: one block per (query row, tile of index keys).

The block TMA-copies a contiguous tile of stored index-key rows (68-byte FP4 rows are dequantised in
registers), scores them against the query's nh heads with the model's roundings and writes the tile's scores;
tiles wholly beyond the query's visible entries read nothing and write -inf. The top-k runs after the kernel
(`xla.topk_lower_index`: per tile, then over the candidates), keeping ties on the lower index.
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from dsjax.kernels.common import gpu_interpret, load_rows, pad_axis, round_bf, row_width
from dsjax.kernels.indexer_topk.xla import topk_lower_index


def index_scores(q, weights, keys, n_visible, row_format, *, block_n: int = 128, interpret=None):
    """q [B,Q,nh,dh], weights [B,Q,nh], keys [B,N,R], n_visible int32 [B,Q] -> fp32 scores [B,Q,N]
    (compute-dtype values; -inf in tiles past n_visible)."""
    B, Q, nh, dh = q.shape
    N = keys.shape[1]
    assert row_width(keys, row_format) == dh, (keys.shape, row_format, dh)
    keys = pad_axis(keys, 1, block_n, 0)        # a copy only when N is not a multiple of block_n
    n_tiles = keys.shape[1] // block_n
    dt = q.dtype

    def body(q_ref, w_ref, nv_ref, k_ref, out_ref, q_s, w_s, nv_s, k_s, out_s, bars):
        r, t = jax.lax.axis_index("row"), jax.lax.axis_index("tile")
        plgpu.copy_gmem_to_smem(nv_ref.at[pl.ds(r, 1)], nv_s, bars.at[0])
        plgpu.barrier_wait(bars.at[0])

        @pl.when(t * block_n < nv_s[0])
        def _score():
            plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(r, 1)], q_s, bars.at[1])
            plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(r, 1)], w_s, bars.at[2])
            plgpu.copy_gmem_to_smem(k_ref.at[r // Q, pl.ds(t * block_n, block_n)], k_s, bars.at[3])
            for i in (1, 2, 3):
                plgpu.barrier_wait(bars.at[i])
            k = round_bf(load_rows(k_s[...], row_format), dt)                        # [bn, dh]
            s = jax.lax.dot_general(q_s[0].astype(jnp.float32), k, (((1,), (1,)), ((), ())),
                                    precision=jax.lax.Precision.HIGHEST)              # [nh, bn]
            s = round_bf(jnp.maximum(round_bf(s, dt), 0) * w_s[0].astype(jnp.float32)[:, None], dt)
            out_s[...] = round_bf(jnp.sum(s, axis=0), dt)[None]

        @pl.when(t * block_n >= nv_s[0])
        def _skip():
            out_s[...] = jnp.full((1, block_n), -jnp.inf, jnp.float32)

        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_s, out_ref.at[pl.ds(r, 1), pl.ds(t * block_n, block_n)])
        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((B * Q, n_tiles * block_n), jnp.float32),
        grid=(B * Q, n_tiles), grid_names=("row", "tile"),
        scratch_types=[plgpu.SMEM((1, nh, dh), dt), plgpu.SMEM((1, nh), weights.dtype), plgpu.SMEM((1,), jnp.int32),
                       plgpu.SMEM((block_n, keys.shape[-1]), keys.dtype), plgpu.SMEM((1, block_n), jnp.float32),
                       plgpu.Barrier(num_barriers=4)],
        interpret=gpu_interpret(interpret),
    )
    scores = kernel(q.reshape(B * Q, nh, dh), weights.reshape(B * Q, nh), n_visible.reshape(B * Q).astype(jnp.int32), keys)
    return scores.reshape(B, Q, -1)[..., :N]


def indexer_topk(q, weights, keys, n_visible, k: int, *, row_format, block_n: int = 128, tile: int = 4096,
                 interpret=None):
    scores = index_scores(q, weights, keys, n_visible, row_format, block_n=block_n, interpret=interpret)
    return topk_lower_index(scores, n_visible, k, tile)
