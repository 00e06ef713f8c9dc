"""The expert kernels' A operands in one launch: rows gathered into tiles, columns in the MMA's order, FP8 codes.

Why: `mosaic_fp4.tile_gemm` takes its pairs' activations as x_tiles [T, K / 32, N, 32] (each 32-column block of
a tile's N pairs side by side, columns in `mma_columns` order) and, in the FP8 form, per-128-column scales
[T, K / 128, N]. XLA built them from x [n, D] and from the up kernel's h [T, I, N] in a chain of transposes, the
codes kernel and masks — at 8 decode tokens about a dozen of the op's 18 glue kernels (docs/benchmarks.md, the
8-token profile of 2026-12-04). Here one Triton program per (tile, scale block, 32 slots) reads its pairs' rows wherever
they lie (a row offset and a column stride: token rows of x, or the columns of h as the up kernel stored them),
quantizes them as `quant.fp8_e4m3_row_codes` does (a slot's amax over its rows of the program's tile, so each
value is read once) and writes both outputs in the kernel's layout.
`tile_operands_xla` is the same contract in XLA ops (the reference and the `codes_kernel=False` path).
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from dsjax import quant
from dsjax.kernels.common import gather, iota, pow2_ceil, triton_interpret, triton_params
from dsjax.kernels.moe_gemm.mosaic_fp4 import BLOCK, QUAD, mma_columns   # a K block (x_tiles' rows); a scale's columns

SLOTS = 32      # slots a program at most (its selects are [4 x slots, slots]): wider tiles take several programs


def source_column(j, fp8: bool):
    """Position j (0..31) of a 32-column block in the MMA's K order -> the column it takes (`mosaic_fp4.mma_columns`
    as integer arithmetic, so a kernel can compute its gather addresses). fp8: position 16h + 4t + i takes column
    8t + 2i + h; bf16: position 8c + 2t + j' takes column 8t + c + 4j'."""
    if fp8:
        return 8 * ((j // 4) % 4) + 2 * (j % 4) + j // 16
    return 8 * ((j // 2) % 4) + j // 8 + 4 * (j % 2)


def _check(src, row_offset, K: int, block: int, shape) -> tuple[int, int]:
    """The tiles and slots (T, N): row_offset's shape, or `shape` for a flat row_offset of at least T x N."""
    if K % block or block % QUAD:
        raise ValueError(f"tile_operands: {K} columns must be whole scale blocks of {block}, a multiple of {QUAD}")
    if src.ndim != 1:
        raise ValueError(f"tile_operands: src must be flat, got {src.shape}")
    if src.size >= 2 ** 31:
        raise ValueError(f"tile_operands: {src.size} source elements; int32 row offsets address fewer than 2^31")
    if row_offset.ndim == 2 and shape in (None, row_offset.shape):
        return row_offset.shape
    if row_offset.ndim == 1 and shape is not None and len(shape) == 2 and row_offset.size >= shape[0] * shape[1]:
        return tuple(shape)
    raise ValueError(f"tile_operands: row_offset must be [T, N], or flat with at least T x N entries and "
                     f"shape=(T, N); got {row_offset.shape} with shape={shape}")


def tile_operands(src, row_offset, col_stride: int, K: int, *, codes: bool, block: int = QUAD, shape=None,
                  interpret=None, trigger: bool = False):
    """src: the rows' values, flat (bf16); row_offset [T, N] int32 (or flat, slot (t, n) at t x N + n, with
    shape=(T, N); entries past T x N are not read): where slot (t, n)'s row starts in src (-1: an empty slot,
    zeros); column c of that row lies at row_offset + c * col_stride. -> (x_tiles [T, K / 32, N, 32]:
    e4m3 codes (codes) or the values, columns in `mma_columns` order; x_scales [T, K / 128, N] fp32, 0 for empty
    slots, or None). codes: quantized per `block` columns of a row, equal to `quant.fp8_e4m3_codes(row, block)`.
    trigger: each program first lets a programmatic dependent launch (`griddepcontrol.launch_dependents`, compiled
    only), so the next kernel, if it is one (the op's down launch with `down_prewait`), starts its work that needs
    none of these outputs while this one runs; it waits for them with `griddepcontrol.wait`."""
    T, N = _check(src, row_offset, K, block, shape)
    G = block // BLOCK                                   # 32-column blocks a program
    S = min(N, SLOTS)                                    # slots a program
    R = pow2_ceil(G * S)                                 # rows of a program's register tile
    Sp = pow2_ceil(S)                                    # slots, padded to a power of two (Triton's ranges)
    Q = block // QUAD
    interpreting = triton_interpret(interpret) not in (None, False)

    def body(src_ref, off_ref, tiles_ref, *scales_ref):
        t, kb = pl.program_id(0), pl.program_id(1)
        r = iota(R)
        if trigger and not interpreting:        # r through the statement, so the (pure) statement is kept
            r = plt.elementwise_inline_asm("griddepcontrol.launch_dependents;\n\tmov.b32 $0, $1;", args=[r],
                                           constraints="=r,r", pack=1,
                                           result_shape_dtypes=[jax.ShapeDtypeStruct(r.shape, r.dtype)])[0]
        local, g = r % S, r // S
        s = pl.program_id(2) * S + local
        live = (r < G * S) & (s < N)
        off = jnp.where(live, gather(off_ref, t * N + s, mask=live), -1)
        ok = (off >= 0)[:, None]
        j = iota(BLOCK)[None, :]
        cols = kb * block + BLOCK * g[:, None] + source_column(j, codes)
        part = gather(src_ref, off[:, None] + cols * col_stride, mask=ok)          # [R, 32]: row (g, s)
        out_rows = ((t * (K // BLOCK) + kb * G + g) * N + s)[:, None]
        if not codes:
            plt.store(tiles_ref.at[out_rows, j], part.astype(tiles_ref.dtype), mask=live[:, None])
            return
        # a slot's amax over its G rows (the whole scale block), back on each of them: selects over [R, Sp]
        part = part.astype(jnp.float32)
        same_slot = local[:, None] == iota(Sp)[None, :]
        slot_max = jnp.max(jnp.where(same_slot, jnp.max(jnp.abs(part), axis=1)[:, None], 0.0), axis=0)
        e = quant.fp8_e4m3_exponent_of(jnp.sum(jnp.where(same_slot, slot_max[None, :], 0.0), axis=1))
        plt.store(tiles_ref.at[out_rows, j], quant.fp8_e4m3_codes_at(part, e), mask=live[:, None])
        at = (t * (K // QUAD) + kb * Q + g) * N + s
        plt.store(scales_ref[0].at[at], jnp.where(ok[:, 0], quant.pow2_of(e), 0.0), mask=live & (g < Q))

    dtype = jnp.float8_e4m3fn if codes else src.dtype
    out_shape = [jax.ShapeDtypeStruct((T * (K // BLOCK) * N, BLOCK), dtype)]
    if codes:
        out_shape.append(jax.ShapeDtypeStruct((T * (K // QUAD) * N,), jnp.float32))
    outs = pl.pallas_call(
        body, out_shape=out_shape, grid=(T, K // block, pl.cdiv(N, S)),
        compiler_params=triton_params(4, 1), interpret=triton_interpret(interpret),
        name="moe_tile_operands")(src, row_offset.reshape(-1).astype(jnp.int32))
    tiles = outs[0].reshape(T, K // BLOCK, N, BLOCK)
    return (tiles, outs[1].reshape(T, K // QUAD, N)) if codes else (tiles, None)


def tile_operands_xla(src, row_offset, col_stride: int, K: int, *, codes: bool, block: int = QUAD, shape=None,
                      interpret=None):
    """`tile_operands`' contract in XLA ops: gather the rows, quantize them (`quant.fp8_e4m3_codes`), move the
    columns (`mosaic_fp4.mma_columns`) and the axes."""
    del interpret
    T, N = _check(src, row_offset, K, block, shape)
    row_offset = row_offset.reshape(-1)[:T * N].reshape(T, N)
    ok = row_offset >= 0
    rows = src[jnp.where(ok, row_offset, 0)[..., None] + jnp.arange(K, dtype=jnp.int32) * col_stride]
    rows = jnp.where(ok[..., None], rows, jnp.zeros((), src.dtype))                   # [T, N, K]
    if codes:
        values, scales = quant.fp8_e4m3_codes(rows, block)
        scales = jnp.where(ok[..., None], jnp.repeat(scales, block // QUAD, axis=-1), 0.0).transpose(0, 2, 1)
    else:
        values, scales = rows, None
    tiles = mma_columns(values, fp8=codes).reshape(T, N, K // BLOCK, BLOCK).transpose(0, 2, 1, 3)
    return tiles, scales
