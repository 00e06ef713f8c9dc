"""FP4 experts on FP8 tensor cores through Mosaic GPU (`plgpu.kernel`, wgmma with A in registers): the decode-sized
expert GEMM that owns its register layout.

Why (issue 8): the Triton kernels decode FP4 weights to bf16 on CUDA cores (~3.5 integer ops and one fp32 FMA a
weight: ALU-bound at 24-31% of the copy bandwidth), and their FP8 tensor-core form lost because each 32-column
scale block needs its own dot and layout change. Here the weight codes go to the tensor cores as they lie:

- A warpgroup owns 64 weight rows (wgmma's M) of one expert; the tile's pairs are N (8). Each thread loads, per
  row it holds (two: g and g + 8) and per 32-column scale block, one 32-bit word of 8 codes — the word its lane
  position needs (`WORDS_LAYOUT`: lanes 4g..4g+3 read the block's 16 bytes of row g, `ldmatrix`-friendly).
- The word becomes two registers of 4 e4m3 bytes by moving bits (`common.fp4_e4m3_words`: e2m1 s|e1 e0|m ->
  s|0 0 e1 e0|m 0 0, the value times 2^-6, ~7 integer ops per 8 codes), which are the thread's A-fragment
  registers of one wgmma m64n8k32 — by construction, no shuffle: the even codes fill K positions 4t..4t+3, the odd
  ones 16+4t..16+4t+3 (`_register_blocks`, `mma_columns`). The activation columns are permuted the same way
  outside (a dot product does not care about the order of its terms), so no weight is ever re-laid out in memory.
- One wgmma per scale block (K = 32) into its own zeroed accumulator; the block's partial [64, 8] is promoted in
  fp32 times the weight scale (per row, x 2^6) and, per 128 columns, the activation scale (per pair).

TMA streams the weight words and the tile's pair rows, a step's columns at a time, through `stages` shared-memory
slots (`plgpu.emit_pipeline`; the pair rows loaded whole were the largest buffer, 64 KB in bf16 at K = 4096); their
scales, the pair weights and the rows' weight scales are loaded once, waited for in the first step. The epilogue
is the Triton kernels' fused one: h = round(swiglu(round(g), round(u)) · routing weight) for gate/up, y rounded for
down; written per tile ([T, rows, pairs]), gathered back to pairs by the caller.

H200 (docs/benchmarks.md, "FP4 experts on FP8 tensor cores", "Pair rows streamed"): 1.4x the Triton kernels at 1
token, 2.2-2.9x at 4-64, up to 83% of the copy bandwidth; with tiles of 32 pairs ("... wider tiles at prefill")
1.7-2.4x at 1-2k tokens; `pallas_triton.moe_gemm` takes it (either form) by default at every batch size.

bf16 activations (the `reference-bf16` numerics) take the same kernel on bf16 tensor cores: each word's nibble
pairs (c, c + 4) become bf16 pairs by moving bits (`common.fp4_pair_bits`, the values times 2^-126, ±0.5 as bf16
subnormals) that are the thread's WGMMA_LAYOUT A registers of column group c (`_register_blocks`), two wgmmas
(K = 16) a scale block, the 2^126 in the block scale, no activation scale. The tensor cores keep the subnormal
inputs (compiled on the H200 against the reference and the Triton kernels); 1.30x the Triton kernels at 1 token,
1.85x at 8, 2.2x at 64 (the conversion to bf16 pairs and twice the wgmmas cost more than the e4m3 form's).

In Mosaic GPU interpret mode (CPU tests) the register reinterpretation (`inline_mgpu`) and the wgmma are replaced by
the same bytes in jnp and a dot of their values; the CUDA lowering of the real path is tested on CPU, its numbers
on the H200.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from dsjax.kernels.common import (check_offsets, fp4_code_to_f32, fp4_e4m3_words, fp4_pair_bits,
                                  fp4_words, gpu_interpret, round_bf)
from dsjax.kernels.moe_gemm import l2_prefetch
from dsjax.kernels.moe_gemm.mosaic_fp4_consumers import consumers_kernel
from dsjax.kernels.moe_gemm.mosaic_fp4_persistent import aligned, persistent_kernel, used_tiles
from dsjax.layers import moe as _moe

ROWS = 64           # weight rows a program: wgmma's M
BLOCK = 32          # FP4 scale block: one wgmma K step (32 e4m3 bytes)
QUAD = 128          # columns of one activation scale block: four weight scale blocks, one u32 word of their scales
CONSUMERS = (1, 2)  # compute warpgroups a program (`tile_gemm`'s consumers) run on a GPU: 4 hung an H100 (2026-12-06;
                    # likely jax's setmaxnreg split asking 488 register slots of the 480 a 5-warpgroup CTA gets)

# Thread (warp w, lane l) of the warpgroup holds words [r, 4b + l % 4] for r = 16w + l // 4 (+ 8), every block b:
# the same rows and K quarter as its registers of wgmma's A fragment (WGMMA_LAYOUT_8BIT).
WORDS_LAYOUT = plgpu.Layout.TILED(plgpu.Tiling(((ROWS, 4), (16, 4), (8, 4), (1,))), warp_dims=(-7,),
                                  lane_dims=(-3, -2), vector_dim=-1)


def mma_columns(x, fp8: bool = True):
    """[..., K] -> the same values with each 32-column block in the kernel's K order (thread t's word holds
    columns 8t..8t+7). fp8 (e4m3 A registers): position 16h + 4t + i takes column 8t + 2i + h — the even codes are
    K positions 4t..4t+3 of the A fragment, the odd ones 16+4t... bf16 (bf16 pairs of nibbles p, p + 4): position
    8c + 2t + j takes column 8t + c + 4j. Applied to the activations; the weights stay as stored."""
    s = x.shape
    if fp8:
        return jnp.moveaxis(x.reshape(s[:-1] + (s[-1] // BLOCK, 4, 4, 2)), -1, -3).reshape(s)
    return jnp.moveaxis(x.reshape(s[:-1] + (s[-1] // BLOCK, 4, 2, 4)), -1, -3).reshape(s)


def _blocks_jnp(even, odd):
    """Interpret mode: words [64, 4n] (even / odd e4m3 bytes) -> n e4m3 [64, 32] in `mma_columns` order."""
    def as_bytes(w):                                # [64, 4n] -> [64, n, 16]: block b, position 4t + i
        b = jnp.stack([(w >> (8 * i)) & 0xFF for i in range(4)], axis=-1).astype(jnp.uint8)
        return b.reshape(w.shape[0], w.shape[1] // 4, 16)
    e, o = as_bytes(even), as_bytes(odd)
    return [lax.bitcast_convert_type(jnp.concatenate([e[:, b], o[:, b]], axis=1), jnp.float8_e4m3fn)
            for b in range(e.shape[1])]


def _register_blocks(sources, fp8: bool):
    """On the GPU: words [64, 4n] in `WORDS_LAYOUT` (one array per A column group: e4m3 even / odd bytes, or the
    four bf16 nibble pairs) -> n A operands [64, 32] in the wgmma layout of their type. Each thread's word of block
    b and row half h is its register of column group g (K 16g + 4t.. for e4m3, 8g + 2t.. for bf16): a bitcast, no
    data movement (`inline_mgpu`, since Pallas has no shape-changing register bitcast)."""
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import vector

    n = sources[0].shape[1] // 4
    dtype, layout, pallas_layout, lanes, elt = (
        (jnp.float8_e4m3fn, mgpu.WGMMA_LAYOUT_8BIT, plgpu.Layout.WGMMA_8BIT, 4, ir.Float8E4M3FNType) if fp8 else
        (jnp.bfloat16, mgpu.WGMMA_LAYOUT, plgpu.Layout.WGMMA, 2, ir.BF16Type))
    out = plgpu.ShapeDtypeStruct((ROWS, BLOCK), dtype, layout=pallas_layout)

    @plgpu.inline_mgpu(arg_types=(WORDS_LAYOUT,) * len(sources), return_type=(out,) * n)
    def assemble(_ctx, *words):
        reg_type = ir.VectorType.get((lanes,), elt.get())
        shape = layout.registers_shape((ROWS, BLOCK))        # (1, groups, 1, 1, 2, 1, 1, 1, 1): group, row half
        blocks = []
        for b in range(n):
            regs = np.empty(shape, dtype=object)
            for group, src in enumerate(words):
                for half_m in range(2):
                    word = vector.extract(src.registers[0, b, 0, 0, half_m, 0, 0, 0, 0], dynamic_position=[],
                                          static_position=ir.DenseI64ArrayAttr.get([0]))
                    regs[0, group, 0, 0, half_m, 0, 0, 0, 0] = mgpu_utils.bitcast(word, reg_type)
            blocks.append(mgpu.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None))
        return tuple(blocks)

    return list(assemble(*sources))


def _bf16_blocks_jnp(words):
    """Interpret mode, bf16 operands: words [64, 4n] -> n bf16 [64, 32] of the codes' values in `mma_columns(...,
    fp8=False)` order (position 8c + 2t + j: nibble c + 4j of word t). The values, not the GPU's bits times 2^-126:
    XLA:CPU flushes those subnormals (the bit recipe has its own test, `fp4_pair_bits`)."""
    n = words.shape[1] // 4
    vals = [fp4_code_to_f32((words >> (4 * i)) & 0xF) for i in range(8)]          # nibble i = c + 4j
    v = jnp.stack(vals, axis=-1).reshape(ROWS, n, 4, 2, 4)                         # [r, b, t, j, c]
    v = v.transpose(0, 1, 4, 2, 3).reshape(ROWS, n, BLOCK).astype(jnp.bfloat16)    # [r, b, c, t, j]
    return [v[:, b] for b in range(n)]


def _scale_column_jnp(sc_s, j, q):
    return sc_s[...][:, q] if j is None else sc_s[j].reshape(ROWS, -1)[:, q]


def _scale_column_mgpu(sc_s, j, q):
    """Column q of the row scales as u32 [64] in the accumulator's row layout (a word holds 4 block scales): of
    scale set j (sc_s[j]: the 64 rows x Q words, flat as [4Q, 16]; j and q may be traced), or with j None of a
    streamed step's [64, words] (`stream_scales`). Each thread loads the words of its two rows (a strided column:
    Mosaic's layout inference takes no swizzle-free strided view, so the two loads are written out)."""
    from jax.experimental.mosaic import gpu as mgpu
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, gpu, memref, vector

    row = plgpu.Layout.WGMMA.reduce(1)
    traced = [plgpu.layout_cast(jnp.full((ROWS,), v, jnp.int32), row)
              for v in ((q,) if j is None or isinstance(j, int) else (q, j))]

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) + (row,) * len(traced),
                       return_type=plgpu.ShapeDtypeStruct((ROWS,), jnp.uint32, layout=row))
    def column(_ctx, ref, qv, jv=None):
        index, i32 = ir.IndexType.get(), ir.IntegerType.get_signless(32)
        c = lambda v: arith.constant(index, v)  # noqa: E731
        scalar = lambda v: arith.index_cast(index, vector.extract(  # noqa: E731
            v.registers.flat[0], dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([0])))
        col = scalar(qv)
        if j is not None:
            lead = c(j) if jv is None else scalar(jv)                # a static set stays a constant index
            per_row = c(ir.MemRefType(ref.type).shape[1] // 4)     # Q words a row (the rows flat as [4Q, 16])
        tid = arith.remui(gpu.thread_id(gpu.Dimension.x), c(128))
        base = arith.addi(arith.muli(arith.divui(tid, c(32)), c(16)), arith.divui(arith.remui(tid, c(32)), c(4)))
        layout = mgpu.WGMMA_ROW_LAYOUT
        regs = np.empty(layout.registers_shape((ROWS,)), dtype=object)     # (1, 1, 2, 1, 1): row half
        for h in range(2):
            at_row = arith.addi(base, c(8 * h))
            if j is None:                                           # a streamed step's [64, words]
                word = memref.load(ref, [at_row, col])
            else:
                at = arith.addi(arith.muli(at_row, per_row), col)
                word = memref.load(ref, [lead, arith.divui(at, c(16)), arith.remui(at, c(16))])
            regs[0, 0, h, 0, 0] = vector.broadcast(ir.VectorType.get((1,), i32), word)
        return mgpu.FragmentedArray(_registers=regs, _layout=layout, _is_signed=False)

    return column(sc_s, *traced)


def scale_byte_f32(u):
    """uint32 ue8m0 bytes e -> fp32 2^(e - 127), `e8m0_to_f32`'s values (byte 0 -> the subnormal 2^-127) by a shift
    and an unsigned max: 0x400000 is 2^-127's bits and every other byte's shifted bits are larger."""
    return lax.bitcast_convert_type(jnp.maximum(u << 23, jnp.uint32(0x00400000)), jnp.float32)


def expert_rows(experts, dtype=jnp.int32):
    """int32 [T] tile experts -> [T, 4] of dtype: one 16-byte row a tile (TMA copies whole 16-byte rows), expert
    first (fp32 holds every expert index exactly: they are < 2^24)."""
    return jnp.pad(experts.astype(dtype)[:, None], ((0, 0), (0, 3)))


def side_layout(x_rows: int, N: int) -> tuple[int, int, int]:
    """(pair-weight row, expert row, rows) of a tile-grid program's one side buffer [rows, N] fp32: the pairs' x
    scales in rows [0, x_rows), their weights in one row, the tile's expert in the first 4 words of the next, each
    part starting on 128 bytes (a tensor-map copy's destination must: `aligned`)."""
    pw_row = aligned(x_rows, N)
    e_row = pw_row + aligned(1, N)
    return pw_row, e_row, e_row + 1


def scale_block_words(block_k: int) -> int:
    """Scale words (4 block scales each, 128 columns) a streamed block holds: whole steps' words and whole 16-byte
    rows (a tensor-map box's row): 4 (two steps) at 256 columns a step."""
    return int(np.lcm(block_k // QUAD, 4))


def streams_scales(K: int, block_k: int) -> bool:
    """Whether a contraction of K can stream its rows' scales (`tile_gemm`'s stream_scales): whole blocks of
    `scale_block_words` (so also 16-byte rows of the [rows, K / 128] words: not V4.1's 2304 / 128 = 18)."""
    return (K // QUAD) % scale_block_words(block_k) == 0


def scales_spec(block_k: int, row_block, first_step):
    """The pipeline's BlockSpec of one Linear's row scales, streamed: words [64 rows, `scale_block_words`] of the
    [E x n_out, K / 128] words, 64-row block `row_block(k)` (the expert's), the block holding step
    first_step + k's words (fetched again for each step that shares it: 1 KB)."""
    SW, per_step = scale_block_words(block_k), block_k // QUAD
    return plgpu.BlockSpec((ROWS, SW), lambda k: (row_block(k), (first_step + k) * per_step // SW))


def weight_spec(W: int, expert, row_block, first_step):
    """The pipeline's BlockSpec of one Linear's weight words: [64 rows, W words] of `expert`'s row block, step k at
    word column (first_step + k) * W; 128-byte swizzled rows (W = 32 at 256 columns a step)."""
    return weight_block_spec(W, lambda k: (expert, row_block, first_step + k))


def weight_block_spec(W: int, index_map, rows: int = ROWS, squeezed: int = 1):
    """`weight_spec` with any map of the pipeline step to (expert, `rows`-row block, W-word column block); with
    `squeezed` > 1, to a block of a stack with that many leading axes taken whole-index (e.g. a layout whose
    (row block, step) boxes are contiguous), the last two being the box's rows and words."""
    return plgpu.BlockSpec((*[None] * squeezed, rows, W), index_map,
                           transforms=(plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128)))


def pair_rows_spec(nb: int, N: int, row_bytes: int, index_map):
    """The pipeline's BlockSpec of a tile's pair rows: nb 32-column blocks of N rows a step, `index_map` of the step
    to (tile, block column, 0, 0); rows of `row_bytes` swizzled as wgmma's B operand reads them."""
    return plgpu.BlockSpec((None, nb, N, BLOCK), index_map,
                           transforms=(plgpu.TilingTransform((8, BLOCK)), plgpu.SwizzleTransform(row_bytes)))


def kernel_refs(refs, fp8: bool, n_lin: int):
    """A `tile_gemm` kernel's refs after (head, x): (x scales or None, pair weights, weight word stacks, scale
    stacks, output, [scratch...]) — both launches take the same operands."""
    refs = list(refs)
    xs_ref = refs.pop(0) if fp8 else None
    pw_ref = refs.pop(0)
    return xs_ref, pw_ref, refs[:n_lin], refs[n_lin:2 * n_lin], refs[2 * n_lin], refs[2 * n_lin + 1:]


def store_unit(accs, o_s, out_ref, pair_weights, *, t, rows, split, split_out: bool, swiglu_limit):
    """One unit's sums out through o_s: the fp32 partials of K split `split` (the caller adds them), or the
    epilogue's bf16 tile (h with `pair_weights`, a [N] shared-memory ref, when there are two Linears; else y)."""
    if split_out:
        for j, acc in enumerate(accs):
            o_s[j] = acc
        plgpu.commit_smem()
        for j in range(len(accs)):
            plgpu.copy_smem_to_gmem(o_s.at[j], out_ref.at[j, split, t, rows])
        return
    weight = None
    if len(accs) == 2:
        N = accs[0].shape[1]
        weight = lax.broadcast_in_dim(plgpu.load(pair_weights, layout=plgpu.Layout.WGMMA.reduce(0)), (ROWS, N), [1])
    o_s[...] = epilogue(accs, weight, swiglu_limit)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_s, out_ref.at[t, rows])


def unit_outputs(n_lin: int, k_splits: int, T: int, n_out: int, N: int, tiles: tuple = ()):
    """(a `tile_gemm` kernel's out_type, its shared-memory output tile for `store_unit`): the fp32 partials
    [n_lin, k_splits, T, n_out, N] through an [n_lin, 64, N] tile when K is split, else the bf16 [T, n_out, N]
    through a [64, N] one; `tiles`: leading axes of the tile (one a consumer warpgroup)."""
    if k_splits > 1:
        return (jax.ShapeDtypeStruct((n_lin, k_splits, T, n_out, N), jnp.float32),
                plgpu.SMEM((*tiles, n_lin, ROWS, N), jnp.float32))
    return jax.ShapeDtypeStruct((T, n_out, N), jnp.bfloat16), plgpu.SMEM((*tiles, ROWS, N), jnp.bfloat16)


def epilogue(accs, weight, swiglu_limit):
    """fp32 sums of one Linear (y) or two (gate, up) -> bf16: y rounded, or h = round(swiglu(round(g), round(u)) ·
    weight) — the Triton kernels' fused epilogue; in the kernel, or after `tile_gemm`'s K splits are added."""
    if len(accs) == 1:
        return accs[0].astype(jnp.bfloat16)
    g, u = (round_bf(a, jnp.bfloat16) for a in accs)
    return (_moe.swiglu(g, u, swiglu_limit, divide=jnp.divide) * weight).astype(jnp.bfloat16)


class StepMath(NamedTuple):
    """One pipeline step of a `tile_gemm` program, the same in the tile grid and the persistent launch: each
    Linear's step words become nb A operands (`operand_blocks`), one wgmma (K = 32) a block into its own zeroed
    accumulator, each block's partial times its rows' scales, per 128 columns times the pairs' activation scales,
    added to the Linear's fp32 sum in block order (so both launches fold a tile's K identically)."""
    fp8: bool               # e4m3 codes on FP8 tensor cores, else bf16 values on bf16 ones
    nb: int                 # 32-column blocks a step
    n_lin: int              # Linears a program (gate and up, or one)
    N: int                  # pairs a tile: wgmma's N
    interpreting: bool
    wait_per_linear: bool
    early_sums: bool = False  # `fold_early`: each block's scaled sum as soon as its wgmma is done
    quad_waits: bool = False  # `fold_by_quad`: a quad of blocks decoded, multiplied, waited for and summed at a time

    @property
    def unscale(self) -> float:
        """The operands are the codes' values times 2^-6 (e4m3) or 2^-126 (bf16 bits; interpreted: the values)."""
        return 64.0 if self.fp8 else 1.0 if self.interpreting else 2.0 ** 126

    def operand_blocks(self, w_s):
        """A step's weight words -> nb A operands [64, 32] (e4m3 or bf16) in `mma_columns` order."""
        return self.decode(plgpu.load(w_s, layout=WORDS_LAYOUT))

    def decode(self, words):
        """Words [64, 4n] in `WORDS_LAYOUT` -> n A operands [64, 32]."""
        if self.interpreting:
            return _blocks_jnp(*fp4_e4m3_words(words)) if self.fp8 else _bf16_blocks_jnp(words)
        return _register_blocks(fp4_e4m3_words(words) if self.fp8 else [fp4_pair_bits(words, c) for c in range(4)],
                                self.fp8)

    def block_dots(self, blocks, x_step, first: int = 0):
        """Each Linear's partials [64, N], fp32, of its blocks (the step's blocks first, first + 1, ...): one wgmma
        (K = 32) a block, all issued before the one wait."""
        nb = len(blocks[0])
        xb = [x_step.at[first + b] for b in range(nb)]
        if self.interpreting:
            return [[jnp.dot(a.astype(jnp.float32), x[...].astype(jnp.float32).T,
                             preferred_element_type=jnp.float32) for a, x in zip(lin_blocks, xb)]
                    for lin_blocks in blocks]

        def dots(*accs):
            for i, acc in enumerate(accs):
                plgpu.wgmma(acc, blocks[i // nb][i % nb], xb[i % nb].transpose((1, 0)))
            return [acc[...] for acc in accs]
        flat = pl.run_scoped(dots, *[plgpu.ACC((ROWS, self.N), jnp.float32)] * (len(blocks) * nb))
        return [flat[j * nb:(j + 1) * nb] for j in range(len(blocks))]

    def scale_column(self, ref, j, q):
        """Quad q's scale words of the 64 rows, u32 [64]: of set j of a whole-K buffer (ref [sets, 4Q, 16]), or with
        j None of a streamed step's [64, words] (q its column there)."""
        return (_scale_column_jnp if self.interpreting else _scale_column_mgpu)(ref, j, q)

    def row_scales(self, words):
        """A quad's scale words of the 64 rows (u32 [64]) -> its 4 block scales per row, fp32 [64] each:
        2^(e - 127), as `e8m0_to_f32` decodes them (byte 0 the subnormal 2^-127) by a shift and an unsigned max
        (0x400000 is 2^-127's bits; every other byte's shifted bits are larger), not a compare and select — per
        weight scale, the most frequent
        non-decode work of a step. The e4m3 form's 2^6 `unscale` is applied to the pairs' activation scales
        instead (`fold`: once a quad, not once a block and row); the bf16 form's 2^126 stays here, where it keeps
        the block's partial times its scale in the normal range."""
        scales = [scale_byte_f32((words >> (8 * i)) & 0xFF) for i in range(4)]
        return scales if self.fp8 else [s * self.unscale for s in scales]

    def fold(self, accs, k, x_step, w_s, scale_words, xs_s):
        """accs (each Linear's fp32 [64, N]) plus step k's products. x_step: the step's pair rows [nb, N, 32];
        w_s: each Linear's step words; scale_words(j, q): Linear j's scale words of quad q (of all K) for the 64
        rows (`scale_column`); xs_s: [Q, N] the pairs' activation scales (e4m3 codes; unused for bf16)."""
        nb, N = self.nb, self.N
        COL = plgpu.Layout.WGMMA.reduce(0)
        quads = [k * (nb // 4) + qq for qq in range(nb // 4)]
        scales = [[self.row_scales(scale_words(j, q)) for q in quads] for j in range(self.n_lin)]
        xs = [lax.broadcast_in_dim(plgpu.load(xs_s.at[q], layout=COL) * self.unscale, (ROWS, N), [1]) if self.fp8
              else None for q in quads]
        if self.early_sums and not self.interpreting:
            return self.fold_early(accs, x_step, w_s, scales, xs)
        if self.quad_waits:
            return self.fold_by_quad(accs, x_step, w_s, scales, xs)
        blocks = [self.operand_blocks(w_s[j]) for j in range(self.n_lin)]
        if self.wait_per_linear:
            parts = [self.block_dots([b], x_step)[0] for b in blocks]
        else:
            parts = self.block_dots(blocks, x_step)
        return self.scaled_sums(accs, lambda j, b: parts[j][b], scales, xs)

    def scaled_sums(self, accs, part, scales, xs):
        """Each Linear's acc plus its step's partials part(j, b) [64, N] times the rows' block scales, summed per
        quad and times the pairs' activation scales (e4m3 form), in block order — the one fold order of both step
        forms (and both launches)."""
        new = []
        for j in range(self.n_lin):
            acc = accs[j]
            for qq in range(self.nb // 4):
                acc = self.quad_sum(acc, [part(j, 4 * qq + i) for i in range(4)], scales[j][qq], xs[qq])
            new.append(acc)
        return tuple(new)

    def quad_sum(self, acc, parts, scales, xs):
        """acc + (Σ_i parts[i] x the rows' scale i) x the pairs' activation scale (e4m3 form), in block order."""
        chunk = None
        for p, ws in zip(parts, scales):
            term = p * lax.broadcast_in_dim(ws, (ROWS, self.N), [0])
            chunk = term if chunk is None else chunk + term
        return acc + (chunk * xs if self.fp8 else chunk)

    def fold_by_quad(self, accs, x_step, w_s, scales, xs):
        """`fold` a quad (4 blocks, 128 columns) at a time: decode its words, its 4 wgmmas, wait, add its scaled sum.
        Fewer registers live at once (a quad's A operands and partials, not a Linear's step) for more programs an
        SM, at more waits a step. The same products and additions in the same order: the same bits."""
        new = []
        for j in range(self.n_lin):
            words, acc = plgpu.load(w_s[j], layout=WORDS_LAYOUT), accs[j]
            for qq in range(self.nb // 4):
                blocks = self.decode(words[:, 16 * qq:16 * (qq + 1)])
                parts = self.block_dots([blocks], x_step, first=4 * qq)[0]
                acc = self.quad_sum(acc, parts, scales[j][qq], xs[qq])
            new.append(acc)
        return tuple(new)

    def fold_early(self, accs, x_step, w_s, scales, xs):
        """`fold` on the GPU with the step's latencies overlapped: Linear j + 1's words are decoded while Linear j's
        wgmmas run, and each block's partial is read as soon as its own wgmma is done (`wgmma_accumulator_load`
        with wait_n = the wgmmas issued after it: one commit group a wgmma), so its scaled sum runs while the later
        blocks' wgmmas are in flight. The same products, scales and additions in the same order as `fold`: the
        same bits."""
        nb, N, n_lin = self.nb, self.N, self.n_lin
        xb = [x_step.at[b] for b in range(nb)]
        total = n_lin * nb

        def dots(*refs):
            for j in range(n_lin):
                blocks = self.operand_blocks(w_s[j])
                for b in range(nb):
                    plgpu.wgmma(refs[j * nb + b], blocks[b], xb[b].transpose((1, 0)))
            at = lambda j, b: j * nb + b  # noqa: E731  (the wgmma's place in issue order)
            return self.scaled_sums(accs, lambda j, b: plgpu.wgmma_accumulator_load(
                refs[at(j, b)], wait_n=total - 1 - at(j, b)), scales, xs)
        return pl.run_scoped(dots, *[plgpu.ACC((ROWS, N), jnp.float32)] * total)


def tile_gemm(x_tiles, x_scales, experts, lins, *, pair_weight=None, swiglu_limit=None, block_k: int = 256,
              stages: int = 3, wait_per_linear: bool = True, k_splits: int = 1, programs: int = 0,
              early_sums: bool = False, pdl: bool = False, quad_waits: bool = False, stream_scales: bool = False,
              consumers: int = 1, prefetch=None, prefetch_step: int = 0, prewait: bool = False, head=None,
              interpret=None):
    """Every tile's pairs times its expert's FP4 weights, on FP8 tensor cores (or bf16 ones for bf16 activations).

    x_tiles:  e4m3 codes or bf16 values [T, K / 32, N, 32]: tile t's N pair rows (zeros where unused), columns in
              `mma_columns(..., fp8)` order, by 32-column block.
    x_scales: fp32 [T, K / 128, N]: the codes' power-of-two scales per 128 columns; None for bf16 values.
    experts:  int32 [T]: the tile's expert, -1 = an unused tile (nothing computed, its output undefined).
    lins:     one FP4 `Linear` stack [E, n_out, K / 2] (+ ue8m0 [E, n_out, K / 32]) -> y; or two (gate, up) with
              pair_weight fp32 [T, N] and swiglu_limit -> h. With one, pair_weight may be any fp32 [T, N] (the op
              passes the up launch's): the kernel copies that operand beside the others but reads it only for h,
              and without one a [T, N] of zeros is made for it — a kernel launch of its own on the GPU.
    wait_per_linear: wait for each Linear's wgmmas before issuing the next's; else one wait a step (H200: within
    3% either way, 1-2% slower at 8-64 tokens).
    k_splits: programs a 64-row block, each over K / k_splits columns (more programs in flight when few tiles
    run, e.g. one decode token's 6); their fp32 partials are added in order, then `epilogue`.
    programs: 0 = one program a unit (tile, 64-row block, K split); > 0 = one launch of that many programs (e.g.
    one an SM, `mosaic_fp4_persistent.SMS`), each streaming its share of the used tiles' units through one
    pipeline (`mosaic_fp4_persistent`): the same outputs, bit for bit.
    early_sums: `StepMath.fold_early` (decode of the next Linear under this one's wgmmas, each block's scaled sum
    as soon as its wgmma is done) instead of all wgmmas waited for before any sum; GPU only (interpreted: `fold`).
    quad_waits: `StepMath.fold_by_quad` (a step's blocks a quad at a time: fewer registers, more waits).
    stream_scales: the rows' block scales streamed beside the weights (`scales_spec`: 64 rows x 4 words every one
    or two steps) instead of loaded for all of K up front (8 KB a Linear at K = 4096): less shared memory a
    program, for more programs an SM. Tile grid only; K / 128 a multiple of 4 (16-byte rows of scale words).
    consumers: 1 = one warpgroup a program, computing and loading; > 1 = programs of `consumers` x 64 rows, one
    compute warpgroup a 64-row block on one load pipeline with its own memory warpgroup (`mosaic_fp4_consumers`):
    the same outputs, bit for bit. Tile grid only. 1 or 2 (`CONSUMERS`): 4 never finished on an H100.
    H100 (docs/benchmarks.md "Warp-specialized programs"): 2 are 6-16% slower than 1 at 4-8 tokens, 9-12% at one;
    opt-in.
    pdl: launch as a programmatic dependent (Hopper PDL, `plgpu.griddepcontrol_wait` first thing in each program,
    before any input is read): the launch and the programs' set-up overlap the previous kernel's end.
    prefetch: an FP4 `Linear` stack (the down projection's, for gate/up) whose tile expert's codes and scales the
    launch's programs pull into L2, each its 1 / (n_out / 64) share, at pipeline step `prefetch_step` (`l2_prefetch`:
    values unchanged; K split 0's programs only). Tile grid only.
    prewait (with pdl): each program reads its tile's expert and prefetches its own weight rows and their scales
    into L2 (`l2_prefetch.issue`) *before* `griddepcontrol.wait`, so the weights start coming while the previous
    kernel ends. Safe only where the experts (`head`, or the [T, 4] rows made here) and the weights were finished
    before the kernel just before this one began — e.g. the down launch, whose head the up launch read. Tile grid,
    one consumer, no stream_scales / quad_waits, no `prefetch`.
    head: the kernel's int32 [>= T, 4] expert rows (`expert_rows(experts)`; rows past T unread) when the caller
    has them — `route_slots` writes them, and one array serves both launches (None: made here, a pad kernel).
    Returns bf16 [T, n_out, N]: y = round(x · Wᵀ), or h = round(swiglu(round(g), round(u)) · weight)."""
    T, nkb, N, _ = x_tiles.shape
    K = nkb * BLOCK
    fp8 = x_tiles.dtype == jnp.float8_e4m3fn
    if not fp8 and x_tiles.dtype != jnp.bfloat16 or fp8 != (x_scales is not None):
        raise ValueError(f"moe_gemm mosaic_fp4: activations as e4m3 codes with their scales or bf16 values alone, "
                         f"got {x_tiles.dtype} with scales {x_scales is not None}")
    E, n_out = lins[0].weight.shape[:2]
    two = len(lins) == 2
    if any(l.fmt != "fp4" or l.block != BLOCK for l in lins):
        raise ValueError(f"moe_gemm mosaic_fp4: FP4 weights with {BLOCK}-column scale blocks only, got "
                         f"{[(l.fmt, l.block) for l in lins]}")
    if n_out % ROWS or K % block_k or block_k % (2 * QUAD) or N % 8 or N > 256:
        raise ValueError(f"moe_gemm mosaic_fp4: n_out {n_out} must be a multiple of {ROWS}, K {K} of block_k "
                         f"{block_k} (itself a multiple of {2 * QUAD}: 128-byte rows of words), pairs {N} a "
                         f"multiple of 8 up to 256")
    if k_splits < 1 or (K // block_k) % k_splits:
        raise ValueError(f"moe_gemm mosaic_fp4: k_splits {k_splits} must divide the {K // block_k} steps of "
                         f"{block_k} columns")
    if programs < 0:
        raise ValueError(f"moe_gemm mosaic_fp4: programs must be 0 (a program a unit) or more, got {programs}")
    if (pdl or stream_scales or consumers != 1) and programs:
        raise ValueError("moe_gemm mosaic_fp4: pdl, stream_scales and consumers are tile grid options (programs=0)")
    if consumers not in CONSUMERS or n_out % (consumers * ROWS) or consumers > 1 and (pdl or stream_scales):
        raise ValueError(f"moe_gemm mosaic_fp4: consumers {consumers} must be one of {CONSUMERS} (4 stopped an H100: "
                         f"docs/kernels.md), with n_out {n_out} a multiple of {ROWS} x consumers and no pdl or "
                         f"stream_scales with more than one")
    if prefetch is not None and (programs or consumers != 1 or not 0 <= prefetch_step < K // block_k // k_splits):
        raise ValueError(f"moe_gemm mosaic_fp4: prefetch is a tile grid option (programs=0, one consumer) at a "
                         f"step of the {K // block_k // k_splits} a program runs, got programs {programs}, consumers "
                         f"{consumers}, prefetch_step {prefetch_step}")
    if prewait and (not pdl or programs or consumers != 1 or quad_waits or stream_scales or prefetch is not None):
        raise ValueError("moe_gemm mosaic_fp4: prewait needs pdl, the tile grid (programs=0, one consumer), no "
                         "quad_waits or stream_scales and no prefetch")
    if head is not None and (programs or consumers != 1 or quad_waits or stream_scales or head.dtype != jnp.int32
                             or head.ndim != 2 or head.shape[0] < T or head.shape[1] != 4):
        raise ValueError(f"moe_gemm mosaic_fp4: a given head is the tile grid's int32 [>= T, 4] expert rows "
                         f"(T = {T}; one consumer, no programs, quad_waits or stream_scales), got "
                         f"{head.dtype}{list(head.shape)}")
    if stream_scales and not streams_scales(K, block_k):
        raise ValueError(f"moe_gemm mosaic_fp4: stream_scales needs K / {QUAD} a multiple of the "
                         f"{scale_block_words(block_k)} scale words a streamed block holds, got K {K}")
    if two and (pair_weight is None or swiglu_limit is None):
        raise ValueError("moe_gemm mosaic_fp4: gate/up needs pair_weight and swiglu_limit")
    W, nb, Q, SW = block_k // 8, block_k // BLOCK, K // QUAD, scale_block_words(block_k)
    row_bytes = BLOCK * x_tiles.dtype.itemsize                      # a pair row's 32-column block
    steps = K // block_k // k_splits                                # pipeline steps a program
    words = [fp4_words(l.weight) for l in lins]                     # [E, n_out, K / 8] u32: 8 codes a word
    # ue8m0 bytes -> u32 words of 4 blocks; a program's 64 rows are contiguous: [E * n_out / 64, 4Q, 16] (rows of
    # 64 bytes: TMA wants 16-byte strides, which a row of Q words is not for every K, e.g. V4.1's 2304 / 128 = 18)
    scales = [fp4_words(l.scale).reshape((E * n_out, Q) if stream_scales else (E * n_out // ROWS, 4 * Q, 16))
              for l in lins]
    pf = (l2_prefetch.operands(prefetch) if prefetch is not None else        # flat [E, M, w] words
          [a for l in lins for a in l2_prefetch.operands(l)] if prewait else [])
    pw = (jnp.zeros((T, N), jnp.float32) if pair_weight is None else pair_weight).astype(jnp.float32)
    if pw.shape != (T, N):
        raise ValueError(f"moe_gemm mosaic_fp4: pair_weight must be [T, N] = {(T, N)}, got {pw.shape}")
    interp = plgpu.InterpretGPUParams() if interpret is True else gpu_interpret(interpret)
    interpreting = interp not in (None, False)
    ACC = plgpu.Layout.WGMMA
    n_lin = len(lins)
    step_math = StepMath(fp8, nb, n_lin, N, interpreting, wait_per_linear, early_sums, quad_waits)
    # with quad_waits or stream_scales the tile's expert, the pairs' x scales (e4m3 codes) and weights share one
    # buffer (`side_layout`): each scratch buffer takes whole KB (Mosaic aligns them to 1,024 bytes), and the KB this
    # saves lets a fourth up program on an SM once its registers allow (quad_waits: 92). The default's registers cap
    # it at 3 either way, so it keeps the three buffers its GPU tests and timings ran with (the shared one has run
    # only interpreted and lowered: no device time was left)
    shared_side = quad_waits or stream_scales
    pw_row, e_row, side_rows = side_layout(Q if fp8 else 1, N)
    side_types = ([plgpu.SMEM((side_rows, N), jnp.float32)] if shared_side else      # expert, x scales, weights
                  [plgpu.SMEM((4,), jnp.int32), plgpu.SMEM((Q if fp8 else 1, N), jnp.float32),
                   plgpu.SMEM((N,), jnp.float32)])

    def body(e_ref, x_ref, *rest):
        n_in = fp8 + 1 + 2 * n_lin                      # the inputs after x, before the prefetched stacks
        pf_refs, rest = rest[n_in:n_in + len(pf)], rest[:n_in] + rest[n_in + len(pf):]
        xs_ref, pw_ref, w_refs, s_refs, out_ref, scratch = kernel_refs(rest, fp8, n_lin)
        if shared_side:
            side_s, *scratch = scratch
            e_s, xs_s, pw_s = side_s.at[e_row, pl.ds(0, 4)], side_s, side_s.at[pw_row]
        else:
            e_s, xs_s, pw_s, *scratch = scratch
        sc_s, o_s, bars = (None, *scratch) if stream_scales else scratch
        t, r, split = lax.axis_index("t"), lax.axis_index("r"), lax.axis_index("s")
        rows = pl.ds(r * ROWS, ROWS)

        def tile_expert():
            plgpu.copy_gmem_to_smem(e_ref.at[t], e_s, bars.at[0])
            plgpu.barrier_wait(bars.at[0])
            return e_s[0].astype(jnp.int32) if shared_side else e_s[0]  # shared: the expert as an fp32 value

        early = pdl and prewait and not interpreting
        if early:                               # the expert and the weights were done before the kernel just before
            e = tile_expert()
            pl.when((e >= 0) & (split == 0))(lambda: l2_prefetch.issue(pf_refs, e, r, n_out // ROWS))
        if pdl and not interpreting:
            plgpu.griddepcontrol_wait()         # the activations are the previous kernel's outputs: read after
        if not early:
            e = tile_expert()

        @pl.when(e >= 0)
        def _tile():
            # the program's side operands, waited for in the first step: the pipeline's first weight and
            # activation loads go out at once, not after a round trip
            xs_dst = xs_s.at[pl.ds(0, Q)] if shared_side else xs_s
            copies = ([(xs_ref.at[t], xs_dst)] if fp8 else []) + [(pw_ref.at[t], pw_s)] + (
                [] if stream_scales else [(s_refs[j].at[e * (n_out // ROWS) + r], sc_s.at[j]) for j in range(n_lin)])
            for i, (src, dst) in enumerate(copies):         # a barrier each: one arrival per copy
                plgpu.copy_gmem_to_smem(src, dst, bars.at[1 + i])

            def step(idx, *refs_and_carry):
                @pl.when(idx[0] == 0)
                def _side_operands():
                    for i in range(len(copies)):
                        plgpu.barrier_wait(bars.at[1 + i])

                if pf_refs and not prewait:
                    pl.when((idx[0] == prefetch_step) & (split == 0))(
                        lambda: l2_prefetch.issue(pf_refs, e, r, n_out // ROWS))
                k = idx[0] + split * steps                 # the step's place in all of K
                x_step, w_s, accs = refs_and_carry[0], refs_and_carry[1:1 + n_lin], refs_and_carry[-1]
                if stream_scales:
                    sc_step = refs_and_carry[1 + n_lin:1 + 2 * n_lin]
                    words = lambda j, q: step_math.scale_column(sc_step[j], None, q % SW)  # noqa: E731
                else:
                    words = lambda j, q: step_math.scale_column(sc_s, j, q)  # noqa: E731
                return step_math.fold(accs, k, x_step, w_s, words, xs_s)

            spec = weight_spec(W, e, r, split * steps)
            # the pair rows stream beside the weights (nb blocks a step): loaded whole up front they were the
            # largest buffer (64 KB at K = 4096 in bf16), waited for before the first weight load
            x_spec = pair_rows_spec(nb, N, row_bytes, lambda k: (t, split * steps + k, 0, 0))
            zeros = tuple(plgpu.layout_cast(jnp.zeros((ROWS, N), jnp.float32), ACC) for _ in range(n_lin))
            streamed = [scales_spec(block_k, lambda k: e * (n_out // ROWS) + r, split * steps)] * n_lin \
                if stream_scales else []
            accs = plgpu.emit_pipeline(step, grid=(steps,), in_specs=[x_spec] + [spec] * n_lin + streamed,
                                       max_concurrent_steps=stages, init_carry=zeros)(
                                           x_ref, *w_refs, *(s_refs if stream_scales else []))
            store_unit(accs, o_s, out_ref, pw_s, t=t, rows=rows, split=split, split_out=k_splits > 1,
                       swiglu_limit=swiglu_limit)
            plgpu.wait_smem_to_gmem(0)

    check_offsets("moe_gemm_mosaic_fp4", x_tiles, *words, *scales)
    split_out = k_splits > 1
    if programs:
        kernel = persistent_kernel(step_math, T=T, n_out=n_out, K=K, block_k=block_k, k_splits=k_splits,
                                   stages=stages, programs=programs, row_bytes=row_bytes, swiglu_limit=swiglu_limit,
                                   interp=interp)
        head = used_tiles(experts)
    elif consumers > 1:
        kernel = consumers_kernel(step_math, T=T, n_out=n_out, K=K, block_k=block_k, k_splits=k_splits,
                                  stages=stages, consumers=consumers, row_bytes=row_bytes, swiglu_limit=swiglu_limit,
                                  interp=interp)
        head = expert_rows(experts)
    else:
        out_type, o_tile = unit_outputs(n_lin, k_splits, T, n_out, N)
        kernel = plgpu.kernel(
            body, out_type=out_type,
            grid=(T, n_out // ROWS, k_splits), grid_names=("t", "r", "s"),
            scratch_types=[
                *side_types,                                                        # expert, x scales, weights
                *([] if stream_scales else [plgpu.SMEM((n_lin, 4 * Q, 16), jnp.uint32)]),  # rows' weight scales
                o_tile,                                                             # the output tile
                plgpu.Barrier(num_barriers=2 + fp8 + (0 if stream_scales else n_lin)),
            ],
            interpret=interp)
        head = expert_rows(experts, jnp.float32 if shared_side else jnp.int32) if head is None else head
    out = kernel(head, x_tiles, *([x_scales] if fp8 else []), pw, *words, *scales, *pf)
    if not split_out:
        return out
    sums = [functools.reduce(jnp.add, [out[j, i] for i in range(k_splits)]) for j in range(n_lin)]
    return epilogue(sums, pw[:, None, :] if two else None, swiglu_limit)


PAIRS = 8           # pairs a tile at decode and verify sizes: wgmma's N
MAX_PAIRS = 32      # the widest default tile


def applies(w1, w2, block_k: int = 256) -> bool:
    """Whether this kernel can run the op: FP4 experts with 32-column scale blocks, whole 64-row blocks and each
    contraction whole steps of `block_k` columns (tiny test models' 128-wide experts are not: the Triton kernels
    take them)."""
    return (all(l.fmt == "fp4" and l.block == BLOCK for l in (w1, w2))
            and all(l.weight.shape[1] % ROWS == 0 and 2 * l.weight.shape[2] % block_k == 0 for l in (w1, w2)))


def default_options(n_pairs: int, n_experts: int) -> dict:
    """`moe_gemm`'s pipeline stages and pairs a tile: tiles as wide as an expert's mean share of the pairs, rounded
    up to 8, 16 or 32 (`PAIRS` .. `MAX_PAIRS`). H200 (docs/benchmarks.md, "... wider tiles at prefill"): 2 stages
    beat 3 by 1-10% in the bf16 form at 1-64 tokens and 16-19% at 1-2k; in the FP8 form by 1-7% at 1-4 tokens,
    within 2% either way above; 8-pair tiles beat 16 and 32 up to 256 tokens of top-6 over 256 experts (6 pairs an
    expert), 24-32 beat 8 by 1.5-2.0x at 1,024-2,048 (each expert's weights read a third or a quarter as often).
    At 1,024 tokens (24 pairs an expert) 32 beat 24 by 15% in the FP8 form and tied (0.7%) in the bf16 form, hence
    the rounding to a power of two; 64 were slower (likely register spills: not profiled)."""
    mean = -(-n_pairs // n_experts)
    pairs = PAIRS
    while pairs < min(mean, MAX_PAIRS):
        pairs *= 2
    return dict(stages=2, pairs=pairs)


def gemm_splits(k_splits) -> tuple[int, int]:
    """`moe_gemm`'s k_splits as (up, down): one int serves both GEMMs."""
    pair = (k_splits, k_splits) if isinstance(k_splits, int) else tuple(k_splits)
    if len(pair) != 2 or not all(isinstance(s, int) and s >= 1 for s in pair):
        raise ValueError(f"moe_gemm mosaic_fp4: k_splits must be a positive int or an (up, down) pair of them, "
                         f"got {k_splits!r}")
    return pair


def moe_gemm(x, weights, ids, w1, w3, w2, *, swiglu_limit, act_quant_sim: bool, act_quant_block: int,
             block_k: int = 256, stages: int | None = None, wait_per_linear: bool = True,
             k_splits: int | tuple[int, int] = 1, interpret=None, codes_kernel: bool = True,
             pairs: int | None = None, route_kernel: bool | None = None, route_warps: int | None = None,
             programs: int = 0, early_sums: bool = False,
             pdl: bool = False, quad_waits: bool = False, stream_scales: bool = False, consumers: int = 1,
             prefetch_down: int | None = None, down_prewait: bool = False, route_head: bool = True):
    """The routed-expert op (`api.moe_gemm`'s contract, bf16 compute) with both GEMMs on `tile_gemm`: pairs grouped
    by expert as the Triton path groups them (`pallas_triton`), tiles of up to `pairs` pairs (wgmma's N: a multiple
    of 8; more pairs a tile read each expert's weights fewer times at prefill sizes, at more registers; default
    `default_options`, as are the stages). With FP8 activations (act_quant_sim) x and h are quantized per tile
    slot as `tile_operands` gathers them into the kernels' A tiles, columns in the kernel's K order (`mma_columns`
    moves columns within 32-column blocks, so each 128-column block's amax, scale and codes are the same), and the
    GEMMs run on FP8 tensor cores; without, on bf16 ones with the bf16 values. h goes to the down kernel as the up
    kernel stored it ([T, I, N]) and y comes back to its pairs from [T, D, N]: no transposes between. codes_kernel:
    `tile_operands` (one Triton launch each for x and h), else the same in XLA ops (`tile_operands_xla`).
    route_kernel: the tile slots from one Triton program (`route_slots`, up to `ROUTE_PAIRS` pairs) instead of
    XLA's small kernels (`route_slots_xla`); default (None): the program from 2 tokens to `ROUTE_PAIRS` pairs, XLA's
    one-token map at one token (H100, 2026-12-06, docs/benchmarks.md "The routing program by default from 2 tokens":
    the op's kernels 1.3-5% faster at 2-8 tokens, equal at one; outputs bit for bit the same); route_warps: its
    warps (default `route_slots.ROUTE_WARPS`, 4; 8 and 16 were no faster, 1 and 2 slower). k_splits: `tile_gemm`'s,
    for each GEMM whose K steps it divides (else 1); a pair (up, down) gives each GEMM its own (one decode token
    runs 192 up programs on 132 SMs but 384 down ones, so a split can pay for one and not the other). programs:
    `tile_gemm`'s (0: the tile grid; e.g. 132: the persistent launch, one program an SM, for both GEMMs).
    early_sums, pdl, quad_waits: `tile_gemm`'s, for both GEMMs; stream_scales too, for each GEMM whose contraction can
    (`streams_scales`; the tile grid only); consumers: `tile_gemm`'s, for each GEMM whose rows it divides (else 1).
    prefetch_down: None, or the up launch's pipeline step at which each of its programs pulls its share of its
    expert's down weights into L2 (`l2_prefetch`; the tile grid only; H100: 2-11% slower at 1-2 tokens, opt-in).
    down_prewait: the down launch as a programmatic dependent (`tile_gemm`'s pdl) whose programs read their expert
    and prefetch their own weights into L2 before waiting for the h codes (`tile_gemm`'s prewait); both launches
    read one [T, 4] expert head, which the up launch's read makes safe for the down launch to read early; the h
    codes' programs let it launch as they start (`tile_operands`' trigger). H100 (2026-12-07): 3-5 µs slower at
    1-2 tokens, 14 at 8 (the early programs crowd the h codes; the down launch's time is its work after the wait);
    opt-in. route_head: the kernels' [T, 4] expert rows from the routing (`route_slots(..., head=True)` writes them
    beside the slots; XLA's one-token map pads them as the kernels would) for both tile-grid launches, instead of a
    pad kernel of their own (~1.1 µs at every size on an H100); the default (H100, 2026-12-07, docs/benchmarks.md
    "The routing writes the kernels' expert rows": the op's kernels ~1 µs less at 2-8 tokens, the same at one, where
    XLA's map pads them either way; outputs bit for bit the same)."""
    from dsjax.kernels.moe_gemm.route_slots import ROUTE_PAIRS, ROUTE_WARPS, route_slots, route_slots_xla
    from dsjax.kernels.moe_gemm.tile_operands import tile_operands, tile_operands_xla
    from dsjax.numerics import sum_in_order

    if act_quant_sim and act_quant_block % QUAD:
        raise ValueError(f"moe_gemm mosaic_fp4: activation scale blocks of {act_quant_block} columns; the kernel "
                         f"takes one scale a {QUAD} columns")
    n, k = ids.shape
    E, I, D = w1.weight.shape[0], w1.weight.shape[1], x.shape[1]
    P = n * k
    defaults = default_options(P, E)
    stages = defaults["stages"] if stages is None else stages
    pairs = defaults["pairs"] if pairs is None else pairs
    if pairs % 8 or not 8 <= pairs <= 256:
        raise ValueError(f"moe_gemm mosaic_fp4: pairs a tile must be a multiple of 8 from 8 to 256, got {pairs}")
    triton_interp = None if interpret is None else bool(interpret)
    if route_kernel is None:
        route_kernel = n > 1
    if route_kernel and P <= ROUTE_PAIRS:
        route = functools.partial(route_slots, warps=ROUTE_WARPS if route_warps is None else route_warps)
    else:
        route = route_slots_xla
    sl = route(weights, ids, E, pairs, D, I, interpret=triton_interp, head=route_head)
    tiled = functools.partial(tile_operands if codes_kernel else tile_operands_xla, codes=act_quant_sim,
                              block=act_quant_block if act_quant_sim else QUAD, interpret=triton_interp)
    opts = dict(block_k=block_k, stages=stages, wait_per_linear=wait_per_linear, programs=programs,
                early_sums=early_sums, pdl=pdl, quad_waits=quad_waits, interpret=interpret)
    wgs = lambda rows: consumers if consumers not in CONSUMERS or rows % (consumers * ROWS) == 0 else 1  # noqa: E731
    up_splits, down_splits = gemm_splits(k_splits)
    splits = lambda K, n: n if (K // block_k) % n == 0 else 1  # noqa: E731
    stream = lambda K: stream_scales and not programs and streams_scales(K, block_k)  # noqa: E731

    slots = (sl.experts.shape[0], pairs)
    # one array of 16-byte expert rows for both launches: the routing's (route_head) or, for down_prewait, one pad;
    # handed to a launch that is the plain tile grid (the other forms make their own), and always with prewait
    head = sl.head if route_head else expert_rows(sl.experts) if down_prewait else None
    plain = lambda rows, K: not (programs or quad_waits or stream(K) or wgs(rows) != 1)  # noqa: E731
    given = lambda rows, K: (dict(head=head) if head is not None and (down_prewait or plain(rows, K))  # noqa: E731
                             else {})
    xt, xs = tiled(x.reshape(-1), sl.x_offset, 1, D, shape=slots)
    h = tile_gemm(xt, xs, sl.experts, [w1, w3], pair_weight=sl.pair_weight, swiglu_limit=swiglu_limit,
                  k_splits=splits(D, up_splits), stream_scales=stream(D), consumers=wgs(I),
                  prefetch=None if prefetch_down is None else w2, prefetch_step=prefetch_down or 0,
                  **given(I, D), **opts)  # [T, I, N]
    trigger = dict(trigger=True) if down_prewait and codes_kernel else {}         # the down launch may start early
    ht, hs = tiled(h.reshape(-1), sl.h_offset, pairs, I, shape=slots, **trigger)   # h's columns as stored
    # the down launch carries the up launch's pair weights unread (one Linear: no h), where zeros were a kernel
    down = dict(opts, **given(D, I), **(dict(pdl=True, prewait=True) if down_prewait else {}))
    y = tile_gemm(ht, hs, sl.experts, [w2], pair_weight=sl.pair_weight, k_splits=splits(I, down_splits),
                  stream_scales=stream(I), consumers=wgs(D), **down)                 # [T, D, N]
    y_pairs = jnp.where(sl.found[:, None], y[sl.slot_of // pairs, :, sl.slot_of % pairs], jnp.zeros((), x.dtype))
    return sum_in_order(y_pairs.reshape(n, k, D).astype(jnp.float32), axis=1)
