"""Mosaic GPU (`plgpu.kernel`) routed-expert GEMM: one program per distinct active expert.

The active experts (ascending, -1 padded) and each token's routing weight per active expert are computed
outside the kernel (`xla.active_experts`, `xla.active_combine`). Program s reads expert active[s] once: it walks
the intermediate dim `block_i` rows at a time, TMA-copies the matching tiles of W1, W3 (rows) and W2 (columns)
with their scales straight from the stored format, dequantises them in registers (FP8 blocks, FP4 nibbles +
ue8m0 scales: `common.dequant_weight`), computes gate and up with fp32 accumulation, the clamped SwiGLU and the
routing weight fused, and accumulates the down projection over the tiles in fp32. It writes its expert's rounded
output for every token [n, D] (0 for tokens that did not pick it); the per-token sum over the active experts in
ascending order runs after the kernel. Padding programs (-1) read nothing and write 0.
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from dsjax import quant
from dsjax.kernels.common import dequant_weight, gpu_interpret, round_bf
from dsjax.kernels.moe_gemm.xla import active_combine, active_experts
from dsjax.layers import moe as _moe
from dsjax.numerics import sum_in_order


def _parts(lin):
    """The stored arrays of a Linear stack: weight, plus its scales when quantised."""
    return [lin.weight] + ([lin.scale] if lin.fmt in ("fp8", "fp4") else [])


def _tile(a, axis: int, inter: int, block_i: int):
    """(entries per tile, tile shape) of stored array a [E, r, c] cut along `axis` (1 rows, 2 cols) whose full
    length stands for `inter` logical values (packed FP4 bytes hold 2, scales hold a block)."""
    per = inter // a.shape[axis]
    n = block_i // per
    shape = list(a.shape[1:])
    shape[axis - 1] = n
    return n, tuple(shape)


def moe_gemm(x, weights, ids, w1, w3, w2, *, swiglu_limit, act_quant_sim, act_quant_block, block_i: int = 128,
             interpret=None):
    n, D = x.shape
    E, inter = w1.weight.shape[0], w2.weight.shape[-1] * (2 if w2.fmt == "fp4" else 1)
    block_i = min(block_i, inter)
    assert inter % block_i == 0, (inter, block_i)
    assert not act_quant_sim or block_i % act_quant_block == 0, (block_i, act_quant_block)
    dt = x.dtype
    active = active_experts(weights, ids, E)
    S = active.shape[0]
    combine = active_combine(weights, ids, active, E).T                       # [S, n]
    xq = quant.fp8_e4m3_sim(x, act_quant_block) if act_quant_sim else x
    n_tiles = inter // block_i

    # (array, axis cut by the tile loop): W1/W3 rows, W2 columns; fixed order -> refs in the body
    mats = [(lin, axis) for lin, axis in ((w1, 1), (w3, 1), (w2, 2))]
    stored = [(a, axis) for lin, axis in mats for a in _parts(lin)]
    tiles = [_tile(a, axis, inter, block_i) for a, axis in stored]
    counts = [len(_parts(lin)) for lin, _ in mats]

    def body(act_ref, cw_ref, x_ref, *refs):
        w_refs, (out_ref,), rest = refs[:len(stored)], refs[len(stored):len(stored) + 1], refs[len(stored) + 1:]
        act_s, cw_s, x_s, out_s = rest[:4]
        tile_s, bars = rest[4:4 + len(stored)], rest[-1]
        s = jax.lax.axis_index("expert")
        plgpu.copy_gmem_to_smem(act_ref.at[pl.ds(s, 1)], act_s, bars.at[0])
        plgpu.barrier_wait(bars.at[0])
        e = act_s[0]

        @pl.when(e >= 0)
        def _expert():
            plgpu.copy_gmem_to_smem(cw_ref.at[pl.ds(s, 1)], cw_s, bars.at[1])
            plgpu.copy_gmem_to_smem(x_ref, x_s, bars.at[2])
            plgpu.barrier_wait(bars.at[1])
            plgpu.barrier_wait(bars.at[2])
            xf = x_s[...].astype(jnp.float32)                                   # [n, D]
            cw = cw_s[0]                                                        # [n]

            def step(t, acc):
                plgpu.commit_smem()   # proxy fence: the last tile's register loads come before TMA overwrites it
                for j, ((a, axis), (ln, _)) in enumerate(zip(stored, tiles)):
                    src = w_refs[j].at[e, pl.ds(t * ln, ln)] if axis == 1 else \
                        w_refs[j].at[e, pl.ds(0, a.shape[1]), pl.ds(t * ln, ln)]
                    plgpu.copy_gmem_to_smem(src, tile_s[j], bars.at[3 + j])
                for j in range(len(stored)):
                    plgpu.barrier_wait(bars.at[3 + j])
                vals, j = [], 0
                for (lin, _), c in zip(mats, counts):
                    scale = tile_s[j + 1][...] if c == 2 else None
                    vals.append(round_bf(dequant_weight(tile_s[j][...], scale, lin.fmt, lin.block), dt))
                    j += c
                dot = lambda a_, w_: jax.lax.dot_general(a_, w_, (((1,), (1,)), ((), ())),
                                                         precision=jax.lax.Precision.HIGHEST)
                g = round_bf(dot(xf, vals[0]), dt)                              # [n, bi]
                u = round_bf(dot(xf, vals[1]), dt)
                h = round_bf(_moe.swiglu(g, u, swiglu_limit) * cw[:, None], dt)
                if act_quant_sim:
                    h = quant.fp8_e4m3_sim(h.astype(dt), act_quant_block).astype(jnp.float32)
                return acc + dot(h, vals[2])                                    # [n, D]

            acc = jax.lax.fori_loop(0, n_tiles, step, jnp.zeros((n, D), jnp.float32))
            out_s[...] = round_bf(acc, dt)[None]

        @pl.when(e < 0)
        def _pad():
            out_s[...] = jnp.zeros((1, n, D), jnp.float32)

        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_s, out_ref.at[pl.ds(s, 1)])
        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((S, n, D), jnp.float32),
        grid=(S,), grid_names=("expert",),
        scratch_types=[plgpu.SMEM((1,), jnp.int32), plgpu.SMEM((1, n), jnp.float32), plgpu.SMEM((n, D), dt),
                       plgpu.SMEM((1, n, D), jnp.float32)]
                      + [plgpu.SMEM(shape, a.dtype) for (a, _), (_, shape) in zip(stored, tiles)]
                      + [plgpu.Barrier(num_barriers=3 + len(stored))],
        interpret=gpu_interpret(interpret),
    )
    per_expert = kernel(active, combine, xq, *(a for a, _ in stored))       # [S, n, D]
    return sum_in_order(per_expert, axis=0)
