"""Routed-expert GEMM lowered through Triton: (token, pick) pairs grouped by expert, tiles of `block_m` pairs.

Outside the kernels (XLA, small): each token's picks sorted by expert, repeated picks merged, pairs with weight 0
(picks held by another expert-parallel shard) dropped, the rest sorted by expert and cut into tiles of at most
`block_m` pairs of one expert (`tile_map`). Two grouped-GEMM kernels (`grouped_matmul`) then read each tile's
expert weights once, straight from the stored format (bf16, FP8 e4m3 + ue8m0 blocks, packed FP4 + per-32 ue8m0),
codes converted in registers, the power-of-two block scale applied to the products (FP8) or to the decoded values
(FP4, read as 32-bit words of 8 codes) (`common.weight_pieces`):

- up: grid (tiles, I / block_i, splits of D): x rows gathered by token, x · W1ᵀ and x · W3ᵀ -> fp32 partials;
- down: grid (tiles, D / block_d, splits of I): h · W2ᵀ -> fp32 partials.

Between and after them, in XLA (elementwise, fused, a few MB at decode): partials summed in split order and
rounded, the clamped SwiGLU times the pair's routing weight rounded to h (FP8 fake quantisation if asked), y
rounded, each token's experts summed in ascending order in fp32. Splitting the contraction lets the 6 experts of
one decode token fill the GPU (`k_splits`); at prefill (many tiles) there is one split and the kernels are a
grouped GEMM over the sorted pairs. With one split (`fused`: the FP8 tensor-core form's default, and any kernel
whose contraction is not split anyway) the kernels finish their rows themselves — the up kernel writes h, the
down kernel y rounded — and only the activation codes, the routing order and the final sum stay in XLA.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from dsjax import quant
from dsjax.kernels.common import (check_offsets, dot_nt, fp4_e4m3_chunk, fp4_words, gather, iota, offsets_fit,
                                  round_bf, triton_interpret, triton_params, weight_pieces)
from dsjax.kernels.moe_gemm import mosaic_fp4
from dsjax.kernels.moe_gemm.act_codes import fp8_codes
from dsjax.kernels.moe_gemm.xla import merged_pair_weights
from dsjax.layers import moe as _moe
from dsjax.numerics import sum_in_order


def tile_map(key, n_experts: int, block_m: int):
    """Pairs' expert keys (n_experts = dropped) -> (order, tiles int32 [T, 3]: expert (-1 = unused tile), first
    sorted pair, end of that expert's pairs). T = ceil(P / block_m) + min(P, E) bounds the tiles any routing
    needs, so the grid is static."""
    P = key.shape[0]
    order = jnp.argsort(key, stable=True)
    counts = jnp.bincount(key, length=n_experts + 1)[:n_experts].astype(jnp.int32)
    starts = jnp.cumsum(counts) - counts
    per = (counts + block_m - 1) // block_m
    tile_end = jnp.cumsum(per)
    T = -(-P // block_m) + min(P, n_experts)
    t = jnp.arange(T, dtype=jnp.int32)
    e = jnp.searchsorted(tile_end, t, side="right", method="compare_all").astype(jnp.int32)  # not a scan loop
    ec = jnp.minimum(e, n_experts - 1)
    row0 = starts[ec] + (t - (tile_end[ec] - per[ec])) * block_m
    tiles = jnp.stack([jnp.where(e < n_experts, e, -1), row0, starts[ec] + counts[ec]], axis=1)
    return order, tiles.astype(jnp.int32)


COUNTED_MAP_PAIRS = 256     # up to this many pairs the tile map counts ([P, P] compares; H200-measured at ≤ 48)


def counted_tile_map(key, n_experts: int, block_m: int):
    """`tile_map`'s pairs order and tiles, by counting instead of sorting: a pair's place in the stable sort is
    the pairs with a smaller key plus the equal ones before it; a tile starts at every `block_m`-th pair of an
    expert. [P, P] compares in a few fused kernels, where the sort, bincount, cumsum and search are a dozen small
    ones (decode and verify batches: P = tokens x 6). Tiles are indexed by pair (T = P; unused ones -1)."""
    P = key.shape[0]
    p = jnp.arange(P, dtype=jnp.int32)
    less = (key[None, :] < key[:, None]).sum(axis=1, dtype=jnp.int32)            # first sorted place of p's expert
    same = key[None, :] == key[:, None]
    rank = less + (same & (p[None, :] < p[:, None])).sum(axis=1, dtype=jnp.int32)
    end = less + same.sum(axis=1, dtype=jnp.int32)
    order = (jnp.where(rank[None, :] == p[:, None], p[None, :], 0)).sum(axis=1, dtype=jnp.int32)
    starts = (key < n_experts) & ((rank - less) % block_m == 0)
    return order, jnp.stack([jnp.where(starts, key, -1), rank, end], axis=1).astype(jnp.int32)


def single_token_tiles(key, n_experts: int):
    """One token (decode at batch 1): its pairs are already in ascending expert order (sorted within the token)
    with repeats merged onto one pair, so each pair is a tile in place — the same tiles `tile_map` makes with
    one-pair tiles, without its sort, counts, cumsum and search (~10 small XLA kernels of a decode step's glue).
    Returns (order = identity, tiles [P, 3])."""
    p = jnp.arange(key.shape[0], dtype=jnp.int32)
    return p, jnp.stack([jnp.where(key < n_experts, key, -1), p, p + 1], axis=1).astype(jnp.int32)


def picks_in_expert_order(ids):
    """Each token's picks [n, k] -> the stable ascending-expert order of its k picks (`jnp.argsort(ids, axis=-1,
    stable=True)`, the reference's summation order) by counting: a pick's place is the picks with a smaller expert
    plus the equal ones before it — [n, k, k] compares in one fused kernel where XLA's sort is its own (k = 6)."""
    k = ids.shape[-1]
    j = jnp.arange(k, dtype=jnp.int32)
    a, b = ids[..., None, :], ids[..., :, None]                     # [n, i, j]: pick j beside pick i
    before = (a < b) | ((a == b) & (j[None, :] < j[:, None]))
    place = before.sum(axis=-1, dtype=jnp.int32)                    # [n, k]: sorted place of pick i
    return (jnp.where(place[..., None, :] == j[:, None], j[None, :], 0)).sum(axis=-1, dtype=jnp.int32)


def expert_pairs(weights, ids, n_experts: int, block_m: int):
    """Routing [n, k] -> the (token, pick) pairs the grouped GEMMs run: each token's picks in ascending expert
    order (the reference's summation order) with repeats merged, as (expert key [P] (n_experts = dropped: weight 0,
    a pick of another shard), pair weight [P], order [P] (sorted place -> pair), tiles [T, 3] of at most block_m
    pairs of one expert). One token's pairs are tiles in place (`single_token_tiles`); up to `COUNTED_MAP_PAIRS`
    pairs the map counts, beyond it sorts. Both expert kernels (Triton, `mosaic_fp4`) group pairs by it."""
    in_row = picks_in_expert_order(ids)
    ids_s = jnp.take_along_axis(ids, in_row, axis=-1).reshape(-1)
    pw = jnp.take_along_axis(merged_pair_weights(weights, ids), in_row, axis=-1).reshape(-1)
    key = jnp.where(pw != 0, ids_s, n_experts)
    if ids.shape[0] == 1:
        order, tiles = single_token_tiles(key, n_experts)
    else:
        order, tiles = (counted_tile_map if key.shape[0] <= COUNTED_MAP_PAIRS else tile_map)(key, n_experts,
                                                                                            block_m)
    return key, pw, order, tiles


# The FP8 tensor-core form by default, per expert format (H200, 2026-12-03, docs/benchmarks.md): FP8 experts gain
# 1.2-1.3x at 1-8 tokens; FP4 experts lose (the per-scale-block dots cost more than the decode saves).
FP8_MMA_DEFAULT = {"fp8": True, "fp4": False, "bf16": False, "f32": False}


def fp8_operands_fit(w1, w2, act_block: int, block_k: int) -> bool:
    """Whether the FP8 tensor-core form applies: FP8 / FP4 experts whose weight pieces (an FP8 chunk, an FP4 scale
    block of 32k columns) each lie inside one activation scale block."""
    def fits(lin):
        width = lin.block if lin.fmt == "fp4" else k_chunk(lin.fmt, lin.block, block_k)
        return lin.fmt in ("fp8", "fp4") and width % 32 == 0 and act_block % width == 0 and (
            lin.fmt == "fp8" or k_chunk("fp4", lin.block, block_k) % lin.block == 0)
    return fits(w1) and fits(w2)


def as_bytes(codes, scales, groups: int = 0, block: int = 0):
    """(e4m3 codes as uint8, scales): the kernels load the codes as bytes and reinterpret them in registers. groups:
    the codes as [rows, groups, n], copy g keeping only the columns of scale blocks ≡ g (mod groups), zero elsewhere
    (`_project`'s "groups" form: a chunk's scale blocks side by side on the MMA's N)."""
    b = jax.lax.bitcast_convert_type(codes, jnp.uint8)
    if groups:
        g = (jnp.arange(b.shape[-1]) // block) % groups
        b = jnp.where(g[None, None, :] == jnp.arange(groups)[None, :, None], b[:, None, :], jnp.uint8(0))
    return b, scales


def k_chunk(fmt: str, block: int, block_k: int) -> int:
    return min(block_k, block) if fmt == "fp8" else max(block_k, block) if fmt == "fp4" else block_k


# Below 16 pairs a tile the MMA (whose M side is at least 16) would mostly multiply padding: such tiles take the
# GEMV form instead — fp32 products accumulated per (pair, weight row, column slot) across the whole contraction and
# reduced once at the end, no operand layout change, no 16-row padding.
MMA_MIN_ROWS = 16
GEMV_TOKENS = 8     # FP4 experts up to this many tokens: GEMV tiles of ≤ 4 pairs, 256-column chunks (H200 sweep)


def piece_columns(lin, bk: int) -> int:
    """Columns of one `weight_pieces` piece: a chunk's words (8 columns apart) for FP4, the whole chunk otherwise."""
    return bk // 8 if lin.fmt == "fp4" else bk


def _project(x_of, lin_refs, lin, e, rows, k_lo, n_chunks: int, bk: int, dtype, acc_rows: int, asm: bool,
             fp8: bool = False, xs_of=None, fp8_dot: str = "pieces"):
    """fp32 [acc_rows, len(rows)] per Linear in lin_refs (sharing one input): Σ over n_chunks chunks from
    k_lo of (x · valuesᵀ) · scale — by MMA, or for tiles under `MMA_MIN_ROWS` pairs by fp32 multiply-adds. fp8
    (FP8 activations) on FP8 tensor cores: per weight piece (an FP8 chunk, an FP4 scale block) codes · codesᵀ,
    times the weight scale per row and the activation scale per pair — weights on the MMA's M side, the tile's
    pairs on N; x_of(columns, first column) gives (e4m3 codes [acc_rows, columns], their scale [acc_rows]) — or,
    in the "groups" form, x_of the codes alone and xs_of(k) the scales at column k."""
    gemv = not fp8 and acc_rows < MMA_MIN_ROWS
    # GEMV tiles take the weights as fp32 (FP4: decoded straight to it); FP8 operands as e4m3 codes
    vals_dtype = jnp.float8_e4m3fn if fp8 else jnp.float32 if gemv else dtype

    if fp8 and fp8_dot == "groups":     # FP4: one dot a chunk, its scale blocks side by side on N
        G = bk // lin.block

        def group_step(c, accs):
            k0 = k_lo + c * bk
            xb = x_of(iota(bk) + k0)                                      # [G * pairs, bk] e4m3
            xsc = xs_of(k0 + iota(G) * lin.block)                         # [G, pairs]
            out = []
            for acc, (w, s) in zip(accs, lin_refs):
                vals, wsc = fp4_e4m3_chunk(w, s, e, rows, k0, bk, lin.block, asm)
                part = dot_nt(vals, xb).reshape(rows.shape[0], G, acc_rows)
                out.append(acc + (part * (wsc[:, :, None] * xsc[None, :, :])).sum(axis=1))
            return tuple(out)

        accs = jax.lax.fori_loop(0, n_chunks, group_step,
                                 tuple(jnp.zeros((rows.shape[0], acc_rows), jnp.float32) for _ in lin_refs))
        return tuple(a.T for a in accs)

    def step(c, accs):
        k0 = k_lo + c * bk
        pieces = [weight_pieces(w, s, e, rows, k0, bk, lin.fmt, lin.block, vals_dtype, asm) for w, s in lin_refs]
        if fp8:             # each piece's codes and scales; the scale block found by the piece's first column
            width = bk // len(pieces[0])
            xs, x_scales = zip(*[x_of(cols, k0 + i * width) for i, (cols, _, _) in enumerate(pieces[0])])
        else:
            xs = [x_of(cols) for cols, _, _ in pieces[0]]
        if gemv:
            xs = [x.astype(jnp.float32)[:, None, :] for x in xs]
        out = []
        for acc, lin_pieces in zip(accs, pieces):
            for i, (xp, (_, vals, scale)) in enumerate(zip(xs, lin_pieces)):
                if fp8:
                    acc = acc + dot_nt(vals, xp) * (scale[:, None] * x_scales[i][None, :])
                elif gemv:
                    acc = acc + xp * (vals if scale is None else vals * scale[:, None])[None, :, :]
                else:
                    part = dot_nt(xp, vals)
                    acc = acc + (part if scale is None else part * scale[None, :])
            out.append(acc)
        return tuple(out)

    shape = ((rows.shape[0], acc_rows) if fp8 else
             (acc_rows, rows.shape[0]) + ((piece_columns(lin, bk),) if gemv else ()))
    accs = jax.lax.fori_loop(0, n_chunks, step, tuple(jnp.zeros(shape, jnp.float32) for _ in lin_refs))
    return tuple(a.T for a in accs) if fp8 else tuple(a.sum(axis=2) for a in accs) if gemv else accs


def _refs(lin, refs):
    """(weight ref, scale ref or None) from a flat ref list consumed in order."""
    w = refs.pop(0)
    return w, (refs.pop(0) if lin.fmt in ("fp8", "fp4") else None)


def _stored(lin, fp4_bytes: bool = False):
    """The arrays a kernel reads: FP4 codes as words (`common.fp4_words`) — or with fp4_bytes as the packed bytes
    where Pallas' int32 offsets reach them (`offsets_fit`) — then the scales if any."""
    weight = lin.weight if lin.fmt == "fp4" and fp4_bytes and offsets_fit(lin.weight) else (
        fp4_words(lin.weight) if lin.fmt == "fp4" else lin.weight)
    return [weight] + ([lin.scale] if lin.fmt in ("fp8", "fp4") else [])


def k_splits(programs: int, chunks: int, target: int) -> int:
    """Splits of the contraction (a power of two dividing `chunks`) so that programs x splits reaches `target`:
    at decode a handful of experts must still fill the GPU."""
    ks = 1
    while programs * ks < target and chunks % (2 * ks) == 0:
        ks *= 2
    return ks


def contraction_splits(tiles: int, n_out: int, block_o: int, n_in: int, bk: int, target: int) -> int:
    """The splits `grouped_matmul` gives a contraction of n_in in chunks of bk unless fused (`k_splits` of its
    tiles x n_out / block_o programs): one rule for the kernel and for `moe_gemm`'s choice of what to fuse."""
    return k_splits(tiles * (n_out // block_o), n_in // bk, target)


def grouped_matmul(name, inp, lin_list, tiles, row_index, n_out: int, block_o: int, bk: int, block_m: int, dt,
                    params, interpret, target: int, fp4_asm: bool = False, inp_scale=None, act_block: int = 0,
                    fp8_dot: str = "pieces", quantize: bool = False, fused: bool = False, swiglu_limit=None,
                    pair_weight=None):
    """fp32 partial products [splits, P_pad, n_out] per Linear of lin_list (same format, same input) for every
    tile's pairs: grid (tiles, n_out / block_o, splits of the contraction). Pair p reads input row
    row_index[p] (x by token) or, with row_index None, row p (h by pair); P_pad = inp rows or len(row_index).
    fp4_asm: FP4 codes decoded by `common.fp4_bf16_asm` (PTX, ~4 integer ops a value instead of ~16) when compiled
    (the interpreter always runs the jnp decode); the default since the H200 run of 2026-12-01 (1.26-1.33x at 1-8
    tokens, bit-identical outputs). inp_scale (fp32 [rows of inp, n_in / act_block]): inp holds FP8 e4m3 codes and
    these their scales — the FP8 tensor-core form (`_project`); quantize: the same form from inp in the compute
    dtype, each chunk (one activation scale block) quantized in registers (`quant.fp8_e4m3_row_codes`).
    fused: one split, and the kernel writes the finished rows instead of partials — [P_pad, n_out] in dt: the
    product rounded (down), or with swiglu_limit and pair_weight (fp32 [P_pad], the pair's routing weight; two
    Linears, gate and up) h = round(swiglu(round(g), round(u)) · weight) (up). Why: at decode the split sums and
    the SwiGLU are small XLA kernels between and after the two GEMMs (docs/benchmarks.md, "The fused epilogue")."""
    T, n_in = tiles.shape[0], inp.shape[-1]
    P_pad = inp.shape[0] if row_index is None else row_index.shape[0]
    lin = lin_list[0]
    if quantize and (bk != act_block or lin.fmt != "fp8"):
        raise ValueError(f"{name}: in-kernel activation quantization needs FP8 weights read in chunks of one "
                         f"activation scale block ({act_block}), got {lin.fmt} in chunks of {bk}")
    if swiglu_limit is not None and (not fused or len(lin_list) != 2 or pair_weight is None):
        raise ValueError(f"{name}: the SwiGLU epilogue needs fused=True, gate and up, and the pair weights")
    ks = 1 if fused else contraction_splits(T, n_out, block_o, n_in, bk, target)
    per = n_in // ks
    fp8 = inp_scale is not None or quantize

    def body(tiles_ref, *rest):
        refs = list(rest)
        idx_ref = refs.pop(0) if row_index is not None else None
        in_ref = refs.pop(0)
        xs_ref = refs.pop(0) if inp_scale is not None else None
        pw_ref = refs.pop(0) if pair_weight is not None else None
        lin_refs = [_refs(lin, refs) for _ in lin_list]
        out_refs = refs
        t, jo, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        e, r0, r_end = tiles_ref[t, 0], tiles_ref[t, 1], tiles_ref[t, 2]

        def tile(m: int):
            rows_p = r0 + iota(m)
            ok = rows_p < r_end
            src = rows_p if idx_ref is None else gather(idx_ref, rows_p, mask=ok)
            out_rows = iota(block_o) + jo * block_o
            if inp.ndim == 3:   # x by scale block of the chunk (`as_bytes(groups=...)`): [G * pairs, bk], [G, pairs]
                gi = iota(inp.shape[1])
                x_of = lambda cols: jax.lax.bitcast_convert_type(gather(  # noqa: E731
                    in_ref, src[None, :, None], gi[:, None, None], cols[None, None, :], mask=ok[None, :, None]),
                    jnp.float8_e4m3fn).reshape(inp.shape[1] * m, cols.shape[0])
                xs_of = lambda ks: gather(  # noqa: E731
                    xs_ref, src[None, :], (ks // act_block)[:, None], mask=ok[None, :])
            else:
                xs_of = None
                x_of = load = lambda cols: gather(in_ref, src[:, None], cols[None, :], mask=ok[:, None])  # noqa: E731
                if quantize:
                    x_of = lambda cols, k: quant.fp8_e4m3_row_codes(load(cols).astype(jnp.float32))  # noqa: E731
                elif xs_ref is not None:    # codes travel as bytes (a masked fp8 load has no typed zero in Triton)
                    x_of = lambda cols, k: (jax.lax.bitcast_convert_type(load(cols), jnp.float8_e4m3fn),  # noqa: E731
                                            gather(xs_ref, src, k // act_block, mask=ok))
            accs = _project(x_of, lin_refs, lin, e, out_rows, s * per, per // bk, bk, dt, m,
                            fp4_asm and not interpret, fp8, xs_of, fp8_dot)
            if not fused:
                for o_ref, acc in zip(out_refs, accs):
                    plt.store(o_ref.at[s, rows_p[:, None], out_rows[None, :]], acc, mask=ok[:, None])
                return
            if swiglu_limit is None:
                out = accs[0]
            else:
                g, u = (round_bf(a, dt) for a in accs)
                out = _moe.swiglu(g, u, swiglu_limit, divide=jnp.divide) * gather(pw_ref, rows_p, mask=ok)[:, None]
            plt.store(out_refs[0].at[rows_p[:, None], out_rows[None, :]], out.astype(dt), mask=ok[:, None])

        if 1 < block_m < MMA_MIN_ROWS and not fp8:   # GEMV tiles: one live pair (decode) costs one row
            pl.when((e >= 0) & (r_end - r0 == 1))(lambda: tile(1))
            pl.when((e >= 0) & (r_end - r0 > 1))(lambda: tile(block_m))
        else:
            pl.when(e >= 0)(lambda: tile(block_m))

    index = [] if row_index is None else [row_index]
    inputs = [inp] + ([] if inp_scale is None else [inp_scale]) + ([] if pair_weight is None else [pair_weight])
    stored = [a for l in lin_list for a in _stored(l, fp8)]
    check_offsets(name, tiles, *index, *inputs, *stored)
    out_shape = ((jax.ShapeDtypeStruct((P_pad, n_out), dt),) if fused else
                 tuple(jax.ShapeDtypeStruct((ks, P_pad, n_out), jnp.float32) for _ in lin_list))
    return pl.pallas_call(body, out_shape=out_shape, grid=(T, n_out // block_o, ks), compiler_params=params,
                          interpret=interpret, name=name)(tiles, *index, *inputs, *stored)


def default_fp4_kernel(w1, w2, block_k: int, *, compiled_on_gpu: bool) -> str:
    """`fp4_kernel`'s default. Measured (H200, docs/benchmarks.md): the Mosaic kernel wins, compiled, where its
    shapes apply, at every batch size (1.3-2.8x at 1-64 tokens, 2.5-3.7x at 128-256, 1.7-2.4x at 1-2k-token
    prefill); the Triton kernels take the rest (interpret mode, tiny models)."""
    return "mosaic" if compiled_on_gpu and mosaic_fp4.applies(w1, w2, block_k) else "triton"


def moe_gemm(x, weights, ids, w1, w3, w2, *, swiglu_limit, act_quant_sim, act_quant_block, block_m: int | None = None,
             block_i: int | None = None, block_d: int | None = None, block_k: int | None = None,
             num_warps: int | None = None, num_stages: int = 3, target_programs: int = 8 * 132, interpret=None,
             fp4_asm: bool = True, fp8_mma: bool | None = None, fp8_dot: str = "pieces", fused: bool | None = None,
             in_kernel_quant: bool = False, codes_kernel: bool = True, fp4_kernel: str | None = None,
             mosaic_block_k: int = 256, mosaic_stages: int | None = None, mosaic_wait_per_linear: bool = True,
             mosaic_k_splits: int | tuple[int, int] = 1, mosaic_pairs: int | None = None,
             mosaic_route_kernel: bool | None = None, mosaic_route_warps: int | None = None, mosaic_programs: int = 0,
             mosaic_early_sums: bool = False,
             mosaic_pdl: bool = False, mosaic_quad_waits: bool = False, mosaic_stream_scales: bool = False,
             mosaic_consumers: int = 1, mosaic_prefetch_down: int | None = None,
             mosaic_down_prewait: bool = False, mosaic_route_head: bool = True):
    """Output tiles default to 32 weight rows for FP4 experts and up to 64 tokens (the H200 sweep's best at 1-8
    tokens: more programs in flight), 64 otherwise; tiles of 16 pairs up to 64 tokens, 32 beyond (the prefill
    sweep at 1,024 / 2,048 tokens: 1.62x / 1.47x over 16; 64 and 128 were slower) (docs/benchmarks.md). FP4 experts
    at ≤ `GEMV_TOKENS` tokens: GEMV tiles of up to 4 pairs (a tile with one live pair runs as one row) and
    256-column chunks where the dims allow (H200: 1.09-1.39x the 16-pair MMA tiles at 1-8 tokens); at one token
    128-row output tiles and 8 warps (fewer, longer programs: 1.07x over 32 rows and 4 warps; 1.15x slower at 8
    tokens). fp8_mma (default per expert format: `FP8_MMA_DEFAULT`): with FP8 activations (act_quant_sim) and FP8 /
    FP4 experts, the kernels take x and h as e4m3 codes and run on FP8 tensor cores (`_project`), MMA tiles of 16
    pairs and 64 weight rows at every batch size; fp8_dot: "pieces" (a dot per FP8 chunk / FP4 scale block) or, for
    FP4, "groups" (a chunk's scale blocks side by side on the MMA's N: one dot a chunk). fused: no split contraction;
    the up kernel writes h (SwiGLU, routing weight and roundings applied), the down kernel y rounded — the XLA kernels
    between the GEMMs go (`grouped_matmul`). Default: both kernels in the FP8 tensor-core form (H200: the splits
    gained nothing there), otherwise each kernel whose contraction would not be split anyway (prefill, larger
    batches). in_kernel_quant (FP8 form, FP8 experts): x and h quantized to e4m3 in the kernels, per chunk, instead
    of by XLA — the fewest kernels (7 at one token), but each of the I / block_i (D / block_d) programs of a tile
    quantizes the same rows: the H200 measured it 5-10% slower at 1 and 4 tokens, so it is off. codes_kernel:
    the FP8 form's x and h codes from one small kernel each (`act_codes.fp8_codes`) instead of XLA's three (with
    fp4_kernel "mosaic": its A tiles, codes and all, from `tile_operands`, else from XLA ops).
    fp4_kernel: "mosaic" — FP4 experts on `mosaic_fp4` (Mosaic GPU: the codes moved to e4m3 — or, with bf16
    activations, bf16 — bits in registers, one wgmma a scale block; mosaic_block_k / mosaic_stages /
    mosaic_wait_per_linear / mosaic_k_splits / mosaic_pairs / mosaic_route_kernel / mosaic_route_warps /
    mosaic_programs / mosaic_early_sums / mosaic_pdl / mosaic_quad_waits / mosaic_stream_scales / mosaic_consumers /
    mosaic_prefetch_down / mosaic_down_prewait / mosaic_route_head are its options, stages and pairs by default
    `mosaic_fp4.default_options`); "triton" — these kernels; default
    (`default_fp4_kernel`): "mosaic" where it applies, compiled on a GPU, at every batch size (H200,
    docs/benchmarks.md "FP4 experts on FP8 tensor cores", "... wider tiles at prefill": 1.3-2.8x these kernels at
    1-64 tokens, 1.7-2.4x at 1-2k tokens)."""
    if fp8_dot not in ("pieces", "groups"):
        raise ValueError(f"moe_gemm pallas: fp8_dot must be 'pieces' or 'groups', got {fp8_dot!r}")
    if fp4_kernel not in (None, "triton", "mosaic"):
        raise ValueError(f"moe_gemm pallas: fp4_kernel must be 'triton' or 'mosaic', got {fp4_kernel!r}")
    if fp4_kernel is None:
        fp4_kernel = default_fp4_kernel(w1, w2, mosaic_block_k,
                                        compiled_on_gpu=interpret in (None, False) and jax.default_backend() == "gpu")
    if fp4_kernel == "mosaic":
        if not mosaic_fp4.applies(w1, w2, mosaic_block_k) or x.dtype != jnp.bfloat16:
            raise ValueError(f"moe_gemm pallas: fp4_kernel='mosaic' needs FP4 experts with 32-column scale blocks, "
                             f"64-row multiples, contractions in whole steps of {mosaic_block_k} columns and bf16 "
                             f"compute")
        return mosaic_fp4.moe_gemm(x, weights, ids, w1, w3, w2, swiglu_limit=swiglu_limit,
                                   act_quant_sim=act_quant_sim, act_quant_block=act_quant_block,
                                   block_k=mosaic_block_k, stages=mosaic_stages,
                                   wait_per_linear=mosaic_wait_per_linear, k_splits=mosaic_k_splits,
                                   interpret=interpret, codes_kernel=codes_kernel, pairs=mosaic_pairs,
                                   route_kernel=mosaic_route_kernel, route_warps=mosaic_route_warps,
                                   programs=mosaic_programs,
                                   early_sums=mosaic_early_sums, pdl=mosaic_pdl, quad_waits=mosaic_quad_waits,
                                   stream_scales=mosaic_stream_scales, consumers=mosaic_consumers,
                                   prefetch_down=mosaic_prefetch_down, down_prewait=mosaic_down_prewait,
                                   route_head=mosaic_route_head)
    n, k = ids.shape
    E, I, D = w1.weight.shape[0], w1.weight.shape[1], x.shape[1]
    fp8_mma = FP8_MMA_DEFAULT[w1.fmt] if fp8_mma is None else fp8_mma
    fp8 = (fp8_mma and act_quant_sim and (block_m or MMA_MIN_ROWS) >= MMA_MIN_ROWS
           and fp8_operands_fit(w1, w2, act_quant_block, block_k or 128))
    gemv = not fp8 and w1.fmt == "fp4" and n <= GEMV_TOKENS
    block_m = block_m or (min(4, 1 << (n - 1).bit_length()) if gemv else 16 if n <= 64 else 32)
    block_k = block_k or (256 if gemv and D % 256 == 0 and I % 256 == 0 else 128)
    one = gemv and n == 1 and I % 128 == 0 and D % 128 == 0
    small = 128 if one else 64 if fp8 else 32 if w1.fmt == "fp4" and n <= 64 else 64
    block_i, block_d, num_warps = block_i or small, block_d or small, num_warps or (8 if one else 4)
    dt = x.dtype
    if dt == jnp.float32 or w1.fmt == "f32":
        raise ValueError("moe_gemm pallas: bf16 compute only (fp32 numerics use the xla path)")
    common = dict(block_m=block_m, dt=dt, params=triton_params(num_warps, num_stages),
                  interpret=triton_interpret(interpret), target=target_programs, fp4_asm=fp4_asm, fp8_dot=fp8_dot)

    key, pw, order, tiles = expert_pairs(weights, ids, E, block_m)
    one_token = n == 1                              # pairs in place: no permutation to make or undo
    P = n * k
    # one token: every pair reads x row 0 (a constant, no kernel)
    tok = jnp.asarray(np.zeros(P + block_m, np.int32)) if one_token else jnp.pad((order // k).astype(jnp.int32),
                                                                                   (0, block_m))
    groups_of = lambda lin: ((k_chunk("fp4", lin.block, block_k) // lin.block, lin.block)  # noqa: E731
                             if fp8_dot == "groups" and lin.fmt == "fp4" else ())
    bk_up, bk_down = k_chunk(w1.fmt, w1.block, block_k), k_chunk(w2.fmt, w2.block, block_k)
    codes_of = (functools.partial(fp8_codes, block=act_quant_block, interpret=interpret) if codes_kernel else
                functools.partial(quant.fp8_e4m3_codes, block=act_quant_block))
    T = tiles.shape[0]
    if fused is None:   # FP8 form: always (H200); otherwise each kernel whose contraction would not be split anyway
        fuse_up = fp8 or contraction_splits(T, I, block_i, D, bk_up, target_programs) == 1
        fuse_down = fp8 or contraction_splits(T, D, block_d, I, bk_down, target_programs) == 1
    else:
        fuse_up = fuse_down = fused
    if in_kernel_quant and not fp8:     # formats and chunk widths: `grouped_matmul` checks them
        raise ValueError("moe_gemm pallas: in_kernel_quant needs the FP8 tensor-core form (FP8 activations and "
                         "fp8_mma)")
    if in_kernel_quant:     # the kernels quantize each chunk (one scale block) in registers
        xq, xs = x, None
    elif fp8:       # e4m3 codes and their scales: codes x scale = fp8_e4m3_sim(x), exactly
        xq, xs = as_bytes(*codes_of(x), *groups_of(w1))
    else:
        xq, xs = (quant.fp8_e4m3_sim(x, act_quant_block) if act_quant_sim else x), None
    act = dict(act_block=act_quant_block, quantize=in_kernel_quant)
    pw_sorted = jnp.pad(pw if one_token else pw[order], (0, block_m))

    if fuse_up:
        (h,) = grouped_matmul("moe_gemm_up", xq, [w1, w3], tiles, tok, I, block_i, bk_up, inp_scale=xs, fused=True,
                              swiglu_limit=swiglu_limit, pair_weight=pw_sorted, **act, **common)
    else:
        g, u = grouped_matmul("moe_gemm_up", xq, [w1, w3], tiles, tok, I, block_i, bk_up, inp_scale=xs, **act,
                              **common)
        g, u = (round_bf(sum_in_order(a, axis=0), dt) for a in (g, u))
        h = (_moe.swiglu(g, u, swiglu_limit) * pw_sorted[:, None]).astype(dt)
    hs = None
    if fp8 and not in_kernel_quant:
        h, hs = as_bytes(*codes_of(h), *groups_of(w2))
    elif act_quant_sim and not fp8:
        h = quant.fp8_e4m3_sim(h, act_quant_block)
    (y,) = grouped_matmul("moe_gemm_down", h, [w2], tiles, None, D, block_d, bk_down, inp_scale=hs, fused=fuse_down,
                          **act, **common)
    y_sorted = y if fuse_down else sum_in_order(y, axis=0).astype(dt)
    kept = (key if one_token else key[order]) < E   # dropped pairs were never written
    y = jnp.where(kept[:, None], y_sorted[:P], 0)
    if not one_token:
        y = jnp.zeros((P, D), dt).at[order].set(y)
    return sum_in_order(y.reshape(n, k, D).astype(jnp.float32), axis=1)
