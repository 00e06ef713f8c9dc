"""Mosaic GPU (`plgpu.kernel`) lightning-indexer scoring: one block per (`rows_per_program` query rows, tile of
index keys); decode runs one row a program, a prefill chunk several, so each key tile is loaded once for them.

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


def _fp4_decode(k_bufs, fmt, block_n, dt, interpreting):
    """Decode the key tile's FP4 rows once for every query row of the program: the codes (exact in bf16) go
    unscaled into the even / odd swizzled A tiles of each scale block; returns each block's per-row scales."""
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
    scales = []
    for b in range(fmt.dim // fmt.block):
        # the scale column has stride 68: strided load -> plain [bn, 1] SMEM -> row-layout vector
        sc_s[...] = e8m0_to_f32(_load_view(flat_s, rows, (slice(None), slice(half + b, half + b + 1)),
                                           plgpu.Layout.WG_STRIDED((block_n, 1), vec_size=1), interpreting))
        scales.append(_load_view(sc_s, (block_n,), slice(None), plgpu.Layout.WGMMA.reduce(1), interpreting))
    return scales


def _fp4_scores(k_bufs, scales, q_row, fmt, block_n, nh):
    """Σ_dims code·scale·q for one query row against the decoded tile, as Σ_blocks scale[n, b] · (codes_b ·
    q_bᵀ): one pair of K = block/2 wgmmas (even, odd dims) a scale block, its per-row scale applied in registers.
    Exact: scales are powers of two."""
    _, lo_s, hi_s, _, _ = k_bufs
    total = None
    for b in range(fmt.dim // fmt.block):
        def dots(acc_ref):
            plgpu.wgmma(acc_ref, lo_s.at[b], q_row[0].at[b].transpose((1, 0)))
            plgpu.wgmma(acc_ref, hi_s.at[b], q_row[1].at[b].transpose((1, 0)))
            return acc_ref[...]

        part = pl.run_scoped(dots, plgpu.ACC((block_n, nh), jnp.float32))
        part = part * jax.lax.broadcast_in_dim(scales[b], part.shape, [0])
        total = part if total is None else total + part
    return total


def default_rows(n_rows: int, nh: int) -> int:
    """Query rows a program: one for decode-sized calls (≤ 8 rows: more programs), else 128 heads' worth (4 at
    V4.1's 32 heads, 2 at V4's 64). H200, 1,024 queries x 64k-128k bf16 keys (docs/benchmarks.md): 4 rows 254
    TFLOP/s at 32 heads against 232 (8) / 242 (2) / 183 (1); 2 rows 285-289 at 64 heads against 259 (4) / 242-247 (1)."""
    return 1 if n_rows <= 8 else max(1, 128 // nh)


def index_scores(q, weights, keys, n_visible, row_format, *, block_n: int = 128, rows_per_program: int | None = None,
                 interpret=None):
    """q [B,Q,nh,dh], weights [B,Q,nh], keys [B,N,R], n_visible int32 [B,Q] -> fp32 scores [B,Q,N]
    (compute-dtype values; -inf in tiles past the n_visible of every query row of the program).

    rows_per_program: query rows that share each loaded (and, for FP4 rows, decoded) key tile, one wgmma each.
    1 suits decode (a few rows: more programs); a prefill chunk (hundreds of rows) wants 4-8, so the keys are read
    (and decoded) once per that many rows instead of once per row."""
    B, Q, nh, dh = q.shape
    N = keys.shape[1]
    R = default_rows(B * Q, nh) if rows_per_program is None else rows_per_program
    assert row_width(keys, row_format) == dh, (keys.shape, row_format, dh)
    if block_n % 64 or nh % 8 or (keys.dtype == jnp.uint8 and (row_format.block % 16 or
                                                                block_n * row_format.row_bytes % 64)):
        raise ValueError(f"wgmma needs block_n % 64 == 0, nh % 8 == 0 (and FP4 scale blocks of 16k dims), got "
                         f"{block_n=}, {nh=}, {row_format}")
    if R < 1:
        raise ValueError(f"rows_per_program must be at least 1, got {R}")
    keys = pad_axis(keys, 1, block_n, 0)        # a copy only when N is not a multiple of block_n
    n_tiles = keys.shape[1] // block_n
    q, weights = pad_axis(q, 1, R, 0), pad_axis(weights, 1, R, 0)    # padded rows see nothing of their own
    n_visible = pad_axis(n_visible.astype(jnp.int32), 1, R, 0)
    Qp = q.shape[1]
    programs = B * Qp // R
    dt = q.dtype
    compact = keys.dtype == jnp.uint8
    interp = gpu_interpret(interpret)
    interpreting = interp not in (None, False)
    qr = q.reshape(B * Qp, nh, dh)
    if compact:    # the even / odd dims of q meet the low / high nibbles of the packed key bytes
        nb, hb = dh // row_format.block, row_format.block // 2    # per scale block: [nb, nh, block/2] each
        qs = tuple(x.reshape(B * Qp, nh, nb, hb).transpose(0, 2, 1, 3) for x in (qr[..., 0::2], qr[..., 1::2]))
        sw = row_format.block // 2 * jnp.dtype(dt).itemsize    # K slices of one scale block = whole swizzle tiles
        key_scratch = [plgpu.SMEM((block_n * keys.shape[-1] // 64, 64), jnp.uint8),
                       wgmma_smem((nb, block_n, hb), dt, sw), wgmma_smem((nb, block_n, hb), dt, sw),
                       plgpu.SMEM((block_n, hb), dt), plgpu.SMEM((block_n, 1), jnp.float32)]
    else:
        qs = (qr,)
        key_scratch = [wgmma_smem((block_n, dh), dt)]
    q_scratch = [wgmma_smem((R,) + x.shape[1:], dt, sw if compact else None) for x in qs]
    nq = len(qs)

    def body(*refs):
        q_refs, (w_ref, nv_ref, k_ref, out_ref) = refs[:nq], refs[nq:nq + 4]
        q_s, (w_s, nv_s, out_s, bars), k_bufs = refs[nq + 4:2 * nq + 4], refs[2 * nq + 4:2 * nq + 8], refs[2 * nq + 8:]
        p, t = jax.lax.axis_index("rows"), jax.lax.axis_index("tile")
        plgpu.copy_gmem_to_smem(nv_ref.at[p], nv_s, bars.at[0])   # TMA rows are >= 16 bytes: [4]
        plgpu.barrier_wait(bars.at[0])

        @pl.when(t * block_n < nv_s[0])
        def _score():
            for i in range(nq):
                plgpu.copy_gmem_to_smem(q_refs[i].at[pl.ds(p * R, R)], q_s[i], bars.at[1 + i])
            plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(p * R, R)], w_s, bars.at[3])
            batch = p * R // Qp
            if compact:   # 68-byte rows break TMA's 16-byte GMEM strides: copy the tile as flat 64-byte lines
                lines = block_n * row_format.row_bytes // 64
                src = k_ref.at[batch, pl.ds(t * lines, lines)]
            else:
                src = k_ref.at[batch, pl.ds(t * block_n, block_n)]
            plgpu.copy_gmem_to_smem(src, k_bufs[0], bars.at[4])
            for i in list(range(1, 1 + nq)) + [3, 4]:
                plgpu.barrier_wait(bars.at[i])
            scales = _fp4_decode(k_bufs, row_format, block_n, dt, interpreting) if compact else None
            for j in range(R):
                if compact:
                    s = _fp4_scores(k_bufs, scales, [x.at[j] for x in q_s], row_format, block_n, nh)
                else:
                    def dots(acc_ref):
                        plgpu.wgmma(acc_ref, k_bufs[0], q_s[0].at[j].transpose((1, 0)))
                        return acc_ref[...]
                    s = pl.run_scoped(dots, plgpu.ACC((block_n, nh), jnp.float32))       # [bn, nh]
                w = plgpu.load(w_s.at[j], layout=plgpu.Layout.WGMMA.reduce(0)).astype(jnp.float32)
                s = round_bf(jnp.maximum(round_bf(s, dt), 0) * jax.lax.broadcast_in_dim(w, s.shape, [1]), dt)
                out_s.at[j][...] = round_bf(s.sum(axis=1), dt)

        @pl.when(t * block_n >= nv_s[0])
        def _skip():
            out_s[...] = jnp.full((R, block_n), -jnp.inf, jnp.float32)

        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_s, out_ref.at[pl.ds(p * R, R), pl.ds(t * block_n, block_n)])
        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((B * Qp, n_tiles * block_n), jnp.float32),
        grid=(programs, n_tiles), grid_names=("rows", "tile"),
        scratch_types=[*q_scratch, plgpu.SMEM((R, nh), weights.dtype), plgpu.SMEM((4,), jnp.int32),
                       plgpu.SMEM((R, block_n), jnp.float32), plgpu.Barrier(num_barriers=5), *key_scratch],
        interpret=interp,
    )
    if compact:
        keys = keys.reshape(B, -1, 64)            # free: the same bytes, as 64-byte lines
    reach = jnp.max(n_visible.reshape(programs, R), axis=1, keepdims=True)   # the furthest row of each program
    scores = kernel(*qs, weights.reshape(B * Qp, nh), pad_axis(reach, 1, 4, 0), keys)
    return scores.reshape(B, Qp, -1)[:, :Q, :N]


def indexer_topk(q, weights, keys, n_visible, k: int, *, row_format, block_n: int = 128, tile: int = 4096,
                 rows_per_program: int | None = None, interpret=None):
    scores = index_scores(q, weights, keys, n_visible, row_format, block_n=block_n,
                          rows_per_program=rows_per_program, interpret=interpret)
    return topk_lower_index(scores, n_visible, k, tile)
