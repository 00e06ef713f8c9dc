"""Routed-expert GEMM lowered through Triton: (token, pick) pairs grouped by expert, tiles of `block_m` pairs.

Outside the kernels (XLA, small): each token's picks sorted by expert, repeated picks merged, pairs with weight 0
(picks held by another expert-parallel shard) dropped, the rest sorted by expert and cut into tiles of at most
`block_m` pairs of one expert (`tile_map`). Two kernels then read each tile's expert weights once, straight from
the stored format (bf16, FP8 e4m3 + ue8m0 blocks, packed FP4 + per-32 ue8m0), dequantised in registers:

- up: grid (tiles, I / block_i): x rows gathered by token, gate and up with fp32 accumulation, rounded, the
  clamped SwiGLU and the pair's routing weight fused, h rounded -> h [pairs, I];
- down: grid (tiles, D / block_d): h · W2ᵀ with fp32 accumulation, rounded -> y [pairs, D].

FP8 fake quantisation of h (reference-fp8 numerics) runs between them; the per-token sum over its experts in
ascending order runs after, in fp32. At decode (1–8 tokens x top-6) every tile is one expert read once, split
over I or D so a few experts fill the GPU; at prefill it is a grouped GEMM over the sorted pairs.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from dsjax import quant
from dsjax.kernels.common import (contraction_columns, dot_nt, gather, iota, round_bf, triton_interpret,
                                  triton_params, weight_pieces)
from dsjax.kernels.moe_gemm.xla import merged_pair_weights
from dsjax.layers import moe as _moe
from dsjax.numerics import sum_in_order


def _silu(v):
    """x / (1 + exp(-x)) in fp32 as the kernel computes it (Triton's division may differ from IEEE by an ulp)."""
    return v / (1.0 + jnp.exp(-v))


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
    e = jnp.searchsorted(tile_end, t, side="right").astype(jnp.int32)
    ec = jnp.minimum(e, n_experts - 1)
    row0 = starts[ec] + (t - (tile_end[ec] - per[ec])) * block_m
    tiles = jnp.stack([jnp.where(e < n_experts, e, -1), row0, starts[ec] + counts[ec]], axis=1)
    return order, tiles.astype(jnp.int32)


def _chunk(fmt: str, block: int, block_k: int) -> int:
    return min(block_k, block) if fmt == "fp8" else block_k


def _project(x_of, lin_refs, lin, e, rows, n_in: int, block_k: int, dtype, acc_rows: int):
    """fp32 [acc_rows, len(rows)] per Linear in lin_refs (sharing one input): Σ_chunks x · Wᵀ."""
    bk = _chunk(lin.fmt, lin.block, block_k)

    def step(c, accs):
        k0 = c * bk
        xs = [x_of(cols) for cols in contraction_columns(k0, bk, lin.fmt)]
        out = []
        for acc, (w_ref, s_ref) in zip(accs, lin_refs):
            ws = weight_pieces(w_ref, s_ref, e, rows, k0, bk, lin.fmt, lin.block, dtype)
            out.append(acc + functools.reduce(jnp.add, [dot_nt(xp, wp) for xp, wp in zip(xs, ws)]))
        return tuple(out)

    init = tuple(jnp.zeros((acc_rows, rows.shape[0]), jnp.float32) for _ in lin_refs)
    return jax.lax.fori_loop(0, n_in // bk, step, init)


def _refs(lin, refs):
    """(weight ref, scale ref or None) from a flat ref list consumed in order."""
    w = refs.pop(0)
    return w, (refs.pop(0) if lin.fmt in ("fp8", "fp4") else None)


def _stored(lin):
    return [lin.weight] + ([lin.scale] if lin.fmt in ("fp8", "fp4") else [])


def moe_gemm(x, weights, ids, w1, w3, w2, *, swiglu_limit, act_quant_sim, act_quant_block, block_m: int = 16,
             block_i: int = 64, block_d: int = 64, block_k: int = 128, num_warps: int = 4, num_stages: int = 3,
             interpret=None):
    n, k = ids.shape
    E, I, D = w1.weight.shape[0], w1.weight.shape[1], x.shape[1]
    dt = x.dtype
    if dt == jnp.float32 or w1.fmt == "f32":
        raise ValueError("moe_gemm pallas: bf16 compute only (fp32 numerics use the xla path)")
    interpret = triton_interpret(interpret)
    params = triton_params(num_warps, num_stages)

    # Pairs: picks sorted by expert within each token (the reference's summation order), repeats merged.
    in_row = jnp.argsort(ids, axis=-1, stable=True)
    ids_s = jnp.take_along_axis(ids, in_row, axis=-1).reshape(-1)
    pw = jnp.take_along_axis(merged_pair_weights(weights, ids), in_row, axis=-1).reshape(-1)
    key = jnp.where(pw != 0, ids_s, E)
    order, tiles = tile_map(key, E, block_m)
    T, P = tiles.shape[0], n * k
    pad = block_m                                   # a tile's rows never run past the buffers
    tok = jnp.pad((order // k).astype(jnp.int32), (0, pad))
    pw_sorted = jnp.pad(pw[order], (0, pad))
    xq = quant.fp8_e4m3_sim(x, act_quant_block) if act_quant_sim else x

    def up(tiles_ref, tok_ref, pw_ref, x_ref, *rest):
        *refs, h_ref = rest
        refs = list(refs)
        g_refs, u_refs = _refs(w1, refs), _refs(w3, refs)
        t, it = pl.program_id(0), pl.program_id(1)
        e, r0, r_end = tiles_ref[t, 0], tiles_ref[t, 1], tiles_ref[t, 2]

        @pl.when(e >= 0)
        def _():
            rows_p = r0 + iota(block_m)
            ok = rows_p < r_end
            tok_r = gather(tok_ref, rows_p, mask=ok)
            out_rows = iota(block_i) + it * block_i
            x_of = lambda cols: gather(x_ref, tok_r[:, None], cols[None, :], mask=ok[:, None])
            g, u = _project(x_of, [g_refs, u_refs], w1, e, out_rows, D, block_k, dt, block_m)
            h = _moe.swiglu(round_bf(g, dt), round_bf(u, dt), swiglu_limit, _silu) * gather(pw_ref, rows_p, mask=ok)[:, None]
            plt.store(h_ref.at[rows_p[:, None], out_rows[None, :]], h.astype(dt), mask=ok[:, None])

    h = pl.pallas_call(
        up, out_shape=jax.ShapeDtypeStruct((P + pad, I), dt), grid=(T, I // block_i),
        compiler_params=params, interpret=interpret, name="moe_gemm_up",
    )(tiles, tok, pw_sorted, xq, *_stored(w1), *_stored(w3))
    if act_quant_sim:
        h = quant.fp8_e4m3_sim(h, act_quant_block)

    def down(tiles_ref, h_ref, *rest):
        *refs, y_ref = rest
        d_refs = _refs(w2, list(refs))
        t, jd = pl.program_id(0), pl.program_id(1)
        e, r0, r_end = tiles_ref[t, 0], tiles_ref[t, 1], tiles_ref[t, 2]

        @pl.when(e >= 0)
        def _():
            rows_p = r0 + iota(block_m)
            ok = rows_p < r_end
            out_rows = iota(block_d) + jd * block_d
            h_of = lambda cols: gather(h_ref, rows_p[:, None], cols[None, :], mask=ok[:, None])
            (y,) = _project(h_of, [d_refs], w2, e, out_rows, I, block_k, dt, block_m)
            plt.store(y_ref.at[rows_p[:, None], out_rows[None, :]], y.astype(dt), mask=ok[:, None])

    y_sorted = pl.pallas_call(
        down, out_shape=jax.ShapeDtypeStruct((P + pad, D), dt), grid=(T, D // block_d),
        compiler_params=params, interpret=interpret, name="moe_gemm_down",
    )(tiles, h, *_stored(w2))

    kept = key[order] < E                           # dropped pairs were never written
    y = jnp.zeros((P, D), dt).at[order].set(jnp.where(kept[:, None], y_sorted[:P], 0))
    return sum_in_order(y.reshape(n, k, D).astype(jnp.float32), axis=1)
