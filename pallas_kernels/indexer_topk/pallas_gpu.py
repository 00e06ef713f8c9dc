"""Mosaic GPU (`plgpu.kernel`) lightning-indexer scoring: one block per (query row, tile of index keys).

The scores are one Hopper `wgmma` per tile, keys on the M side: acc[block_n, nh] = K_tile[block_n, dh] ·
q[nh, dh]ᵀ (M = block_n, a multiple of 64; N = nh, a multiple of 8; the query's heads are the B operand, read
transposed from a tiled, swizzled SMEM buffer). ReLU, the head weights (broadcast along the WGMMA columns) and
the head sum (a row reduction of the WGMMA layout) follow in registers with the model's roundings; the tile's
scores are written back through SMEM. Tiles wholly beyond the query's visible entries read nothing and write
-inf. The top-k runs after the kernel (`xla.topk_lower_index`: per tile, then over the candidates), keeping
ties on the lower index.

Key sources: bf16 values are TMA-copied straight into the swizzled A buffer. Compact FP4 rows (uint8) are
copied raw, and dequantised without interleaving the nibbles: low nibbles are the even dims, high nibbles the
odd dims, so the kernel writes two half-width A tiles and runs two wgmmas into the same accumulator against the
even / odd dims of q (split in XLA, a [B·Q, nh, dh] copy).
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from dsjax.kernels.common import (dequant_index_rows_split, gpu_interpret, pad_axis, round_bf, row_width,
                                  wgmma_smem)
from dsjax.kernels.indexer_topk.xla import topk_lower_index


def index_scores(q, weights, keys, n_visible, row_format, *, block_n: int = 128, interpret=None):
    """q [B,Q,nh,dh], weights [B,Q,nh], keys [B,N,R], n_visible int32 [B,Q] -> fp32 scores [B,Q,N]
    (compute-dtype values; -inf in tiles past n_visible)."""
    B, Q, nh, dh = q.shape
    N = keys.shape[1]
    assert row_width(keys, row_format) == dh, (keys.shape, row_format, dh)
    if block_n % 64 or nh % 8:
        raise ValueError(f"wgmma needs block_n % 64 == 0 and nh % 8 == 0, got {block_n=}, {nh=}")
    keys = pad_axis(keys, 1, block_n, 0)        # a copy only when N is not a multiple of block_n
    n_tiles = keys.shape[1] // block_n
    dt = q.dtype
    compact = keys.dtype == jnp.uint8
    qr = q.reshape(B * Q, nh, dh)
    if compact:    # the even / odd dims of q meet the low / high nibbles of the packed key bytes
        qs = (qr[..., 0::2], qr[..., 1::2])
        a_cols = dh // 2
        key_scratch = [plgpu.SMEM((block_n, keys.shape[-1]), jnp.uint8),
                       wgmma_smem((block_n, a_cols), dt), wgmma_smem((block_n, a_cols), dt)]
    else:
        qs = (qr,)
        a_cols = dh
        key_scratch = [wgmma_smem((block_n, dh), dt)]
    q_scratch = [wgmma_smem((nh, a_cols), dt) for _ in qs]
    nq = len(qs)

    def body(*refs):
        q_refs, (w_ref, nv_ref, k_ref, out_ref) = refs[:nq], refs[nq:nq + 4]
        q_s, (w_s, nv_s, out_s, bars), k_bufs = refs[nq + 4:2 * nq + 4], refs[2 * nq + 4:2 * nq + 8], refs[2 * nq + 8:]
        r, t = jax.lax.axis_index("row"), jax.lax.axis_index("tile")
        plgpu.copy_gmem_to_smem(nv_ref.at[r], nv_s, bars.at[0])   # TMA rows are >= 16 bytes: [4]
        plgpu.barrier_wait(bars.at[0])

        @pl.when(t * block_n < nv_s[0])
        def _score():
            for i in range(nq):
                plgpu.copy_gmem_to_smem(q_refs[i].at[r], q_s[i], bars.at[1 + i])
            plgpu.copy_gmem_to_smem(w_ref.at[r], w_s, bars.at[3])
            plgpu.copy_gmem_to_smem(k_ref.at[r // Q, pl.ds(t * block_n, block_n)], k_bufs[0], bars.at[4])
            for i in list(range(1, 1 + nq)) + [3, 4]:
                plgpu.barrier_wait(bars.at[i])
            if compact:
                raw_s, a_s = k_bufs[0], k_bufs[1:]
                for half, vals in zip(a_s, dequant_index_rows_split(raw_s[...], row_format)):
                    half[...] = vals.astype(dt)
                plgpu.commit_smem()          # generic-proxy stores -> visible to the async (wgmma) proxy
            else:
                a_s = k_bufs

            def dots(acc_ref):
                for a, b in zip(a_s, q_s):
                    plgpu.wgmma(acc_ref, a, b.transpose((1, 0)))
                return acc_ref[...]

            s = pl.run_scoped(dots, plgpu.ACC((block_n, nh), jnp.float32))           # [bn, nh]
            w = plgpu.load(w_s, layout=plgpu.Layout.WGMMA.reduce(0)).astype(jnp.float32)
            s = round_bf(jnp.maximum(round_bf(s, dt), 0) * jax.lax.broadcast_in_dim(w, s.shape, [1]), dt)
            out_s[...] = round_bf(s.sum(axis=1), dt)

        @pl.when(t * block_n >= nv_s[0])
        def _skip():
            out_s[...] = jnp.full((block_n,), -jnp.inf, jnp.float32)

        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_s, out_ref.at[r, pl.ds(t * block_n, block_n)])
        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((B * Q, n_tiles * block_n), jnp.float32),
        grid=(B * Q, n_tiles), grid_names=("row", "tile"),
        scratch_types=[*q_scratch, plgpu.SMEM((nh,), weights.dtype), plgpu.SMEM((4,), jnp.int32),
                       plgpu.SMEM((block_n,), jnp.float32), plgpu.Barrier(num_barriers=5), *key_scratch],
        interpret=gpu_interpret(interpret),
    )
    scores = kernel(*qs, weights.reshape(B * Q, nh), pad_axis(n_visible.reshape(B * Q, 1).astype(jnp.int32), 1, 4, 0), keys)
    return scores.reshape(B, Q, -1)[..., :N]


def indexer_topk(q, weights, keys, n_visible, k: int, *, row_format, block_n: int = 128, tile: int = 4096,
                 interpret=None):
    scores = index_scores(q, weights, keys, n_visible, row_format, block_n=block_n, interpret=interpret)
    return topk_lower_index(scores, n_visible, k, tile)
