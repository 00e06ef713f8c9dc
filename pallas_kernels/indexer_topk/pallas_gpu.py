"""Mosaic GPU (`plgpu.kernel`) lightning-indexer scoring: one block per (query row, tile of index keys).

The scores are one Hopper `wgmma` per tile, keys on the M side: acc[block_n, nh] = K_tile[block_n, dh] ·
q[nh, dh]ᵀ (M = block_n, a multiple of 64; N = nh, a multiple of 8; the query's heads are the B operand, read
transposed from a tiled, swizzled SMEM buffer). ReLU, the head weights (broadcast along the WGMMA columns) and
the head sum (a row reduction of the WGMMA layout) follow in registers with the model's roundings; the tile's
scores are written back through SMEM. Tiles wholly beyond the query's visible entries read nothing and write
-inf. The top-k runs after the kernel (`xla.topk_lower_index`: per tile, then over the candidates), keeping
ties on the lower index.

Key sources: bf16 values are TMA-copied straight into the swizzled A buffer. Compact FP4 rows (uint8, 68 bytes:
no TMA or tiled layout accepts that stride) are copied as flat 64-byte lines, read back as [block_n, 68] with
strided register loads, and decoded without interleaving nibbles: per scale block b, the low / high nibbles
(even / odd dims) go unscaled into two swizzled A tiles of block/2 columns, two wgmmas against the even / odd
dims of q (split and grouped by block in XLA, a [B·Q, nh, dh] copy) fill the block's product, and the per-row
scale (a power of two, so this is exact) multiplies it in registers.
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from dsjax.kernels.common import e8m0_to_f32, fp4_code_to_f32, gpu_interpret, pad_axis, round_bf, row_width, wgmma_smem
from dsjax.kernels.indexer_topk.xla import topk_lower_index


def _load_view(ref, shape, idx, layout, interpreting):
    """plgpu.load(ref.reshape(shape).at[idx], layout): a reshaped view of a plain SMEM buffer. Mosaic GPU
    interpret mode has no ref reshape (`Unsupported transform: ReshapeTransform`), so there the whole buffer is
    loaded and the value reshaped — the same bytes, the same result."""
    if interpreting:
        return ref[...].reshape(shape)[idx]
    return plgpu.load(ref.reshape(*shape).at[idx], layout=layout)


def _fp4_scores(k_bufs, q_s, fmt, block_n, nh, dt, interpreting):
    """Σ_dims code·scale·q for raw FP4 rows, as Σ_blocks scale[n, b] · (codes_b · q_bᵀ): the codes (exact in
    bf16) go to SMEM unscaled, each scale block is one pair of K = block/2 wgmmas (even, odd dims), and its
    per-row scale multiplies the block's product in registers. Exact: scales are powers of two."""
    flat_s, lo_s, hi_s, stage_s, sc_s = k_bufs
    rows = (block_n, fmt.row_bytes)
    half, hb = fmt.dim // 2, fmt.block // 2
    strided = plgpu.Layout.WG_STRIDED((block_n, hb), vec_size=1)
    for b in range(fmt.dim // fmt.block):
        # 68-byte rows allow no tiled layout: load the block's bytes strided, decode, stage them in plain SMEM,
        # reload in the WGMMA layout and store into the block's swizzled A tile.
        packed = _load_view(flat_s, rows, (slice(None), slice(b * hb, (b + 1) * hb)), strided,
                            interpreting).astype(jnp.int32)
        for dst, codes in ((lo_s, packed & 0xF), (hi_s, packed >> 4)):
            stage_s[...] = fp4_code_to_f32(codes).astype(dt)
            dst.at[b][...] = plgpu.load(stage_s, layout=plgpu.Layout.WGMMA)
    plgpu.commit_smem()              # generic-proxy stores -> visible to the async (wgmma) proxy
    total = None
    for b in range(fmt.dim // fmt.block):
        def dots(acc_ref):
            plgpu.wgmma(acc_ref, lo_s.at[b], q_s[0].at[b].transpose((1, 0)))
            plgpu.wgmma(acc_ref, hi_s.at[b], q_s[1].at[b].transpose((1, 0)))
            return acc_ref[...]

        part = pl.run_scoped(dots, plgpu.ACC((block_n, nh), jnp.float32))
        # the scale column has stride 68: strided load -> plain [bn, 1] SMEM -> row-layout vector
        sc_s[...] = e8m0_to_f32(_load_view(flat_s, rows, (slice(None), slice(half + b, half + b + 1)),
                                           plgpu.Layout.WG_STRIDED((block_n, 1), vec_size=1), interpreting))
        sc = _load_view(sc_s, (block_n,), slice(None), plgpu.Layout.WGMMA.reduce(1), interpreting)
        part = part * jax.lax.broadcast_in_dim(sc, part.shape, [0])
        total = part if total is None else total + part
    return total


def index_scores(q, weights, keys, n_visible, row_format, *, block_n: int = 128, interpret=None):
    """q [B,Q,nh,dh], weights [B,Q,nh], keys [B,N,R], n_visible int32 [B,Q] -> fp32 scores [B,Q,N]
    (compute-dtype values; -inf in tiles past n_visible)."""
    B, Q, nh, dh = q.shape
    N = keys.shape[1]
    assert row_width(keys, row_format) == dh, (keys.shape, row_format, dh)
    if block_n % 64 or nh % 8 or (keys.dtype == jnp.uint8 and (row_format.block % 16 or
                                                                block_n * row_format.row_bytes % 64)):
        raise ValueError(f"wgmma needs block_n % 64 == 0, nh % 8 == 0 (and FP4 scale blocks of 16k dims), got "
                         f"{block_n=}, {nh=}, {row_format}")
    keys = pad_axis(keys, 1, block_n, 0)        # a copy only when N is not a multiple of block_n
    n_tiles = keys.shape[1] // block_n
    dt = q.dtype
    compact = keys.dtype == jnp.uint8
    interp = gpu_interpret(interpret)
    interpreting = interp not in (None, False)
    qr = q.reshape(B * Q, nh, dh)
    if compact:    # the even / odd dims of q meet the low / high nibbles of the packed key bytes
        nb, hb = dh // row_format.block, row_format.block // 2    # per scale block: [nb, nh, block/2] each
        qs = tuple(x.reshape(B * Q, nh, nb, hb).transpose(0, 2, 1, 3) for x in (qr[..., 0::2], qr[..., 1::2]))
        a_cols = dh // 2
        sw = row_format.block // 2 * jnp.dtype(dt).itemsize    # K slices of one scale block = whole swizzle tiles
        key_scratch = [plgpu.SMEM((block_n * keys.shape[-1] // 64, 64), jnp.uint8),
                       wgmma_smem((nb, block_n, hb), dt, sw), wgmma_smem((nb, block_n, hb), dt, sw),
                       plgpu.SMEM((block_n, hb), dt), plgpu.SMEM((block_n, 1), jnp.float32)]
    else:
        qs = (qr,)
        a_cols = dh
        key_scratch = [wgmma_smem((block_n, dh), dt)]
    q_scratch = [wgmma_smem(x.shape[1:], dt, sw if compact else None) for x in qs]
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
            if compact:   # 68-byte rows break TMA's 16-byte GMEM strides: copy the tile as flat 64-byte lines
                lines = block_n * row_format.row_bytes // 64
                src = k_ref.at[r // Q, pl.ds(t * lines, lines)]
            else:
                src = k_ref.at[r // Q, pl.ds(t * block_n, block_n)]
            plgpu.copy_gmem_to_smem(src, k_bufs[0], bars.at[4])
            for i in list(range(1, 1 + nq)) + [3, 4]:
                plgpu.barrier_wait(bars.at[i])
            if compact:
                s = _fp4_scores(k_bufs, q_s, row_format, block_n, nh, dt, interpreting)
            else:
                def dots(acc_ref):
                    plgpu.wgmma(acc_ref, k_bufs[0], q_s[0].transpose((1, 0)))
                    return acc_ref[...]
                s = pl.run_scoped(dots, plgpu.ACC((block_n, nh), jnp.float32))       # [bn, nh]
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
        interpret=interp,
    )
    if compact:
        keys = keys.reshape(B, -1, 64)            # free: the same bytes, as 64-byte lines
    scores = kernel(*qs, weights.reshape(B * Q, nh), pad_axis(n_visible.reshape(B * Q, 1).astype(jnp.int32), 1, 4, 0), keys)
    return scores.reshape(B, Q, -1)[..., :N]


def indexer_topk(q, weights, keys, n_visible, k: int, *, row_format, block_n: int = 128, tile: int = 4096,
                 interpret=None):
    scores = index_scores(q, weights, keys, n_visible, row_format, block_n=block_n, interpret=interpret)
    return topk_lower_index(scores, n_visible, k, tile)
