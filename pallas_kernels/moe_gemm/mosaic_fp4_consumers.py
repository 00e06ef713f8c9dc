"""The warp-specialized form of `mosaic_fp4.tile_gemm`: a program is `consumers` warpgroups of 64 rows each on one
load pipeline, plus a memory warpgroup that only issues the loads.

Why (issue 8; docs/kernels.md, "The persistent launch", "More programs an SM"): in the tile grid each program's one
warpgroup both computes and issues its loads, so a stage is refilled only when that warpgroup reaches the next
step, after its FP4 decode, wgmmas and scaled sums; more programs an SM (4, 5) read slower and one warpgroup an SM
(the persistent launch) could not keep up. Here the loads are issued by their own warpgroup
(`plgpu.emit_pipeline_warp_specialized`) as soon as a stage is free, the tile's pair rows are loaded once for
`consumers` x 64 rows (not once a 64-row program), and the compute warpgroups take the registers the memory one
gives up (the pipeline's `setmaxnreg` split: one program an SM).

Each consumer folds its 64 rows with `StepMath.fold` exactly as a tile-grid program does (the same blocks, scales
and order), so the outputs equal the tile grid's bit for bit; the side operands (the pairs' x scales and weights,
each consumer's rows' block scales) are copied once by the memory warpgroup and waited for in the first step.

Measured on an H100 (2026-12-06, docs/benchmarks.md "Warp-specialized programs"): bit for bit the tile grid's
outputs, and slower — 2 consumers 6-16% at 4-8 tokens (4 stages the best), 9-12% at one token (96 programs of 128
rows leave 36 SMs idle): three one-warpgroup programs an SM compute more than two warpgroups with a third loading.
4 consumers never finished — likely the pipeline's register split: `setmaxnreg.inc` asks 4 x 112 + 40 register
slots a thread of a 5-warpgroup CTA that launched with 5 x 96 and waits forever — so `tile_gemm` takes only 1 or 2
(`mosaic_fp4.CONSUMERS`). Opt-in.
"""

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

MEMORY_REGISTERS = 40   # the memory warpgroup's registers (it only computes index maps): jax's own kernels' value


def consumers_kernel(step_math, *, T: int, n_out: int, K: int, block_k: int, k_splits: int, stages: int,
                     consumers: int, row_bytes: int, swiglu_limit, interp):
    """The `plgpu.kernel` of the warp-specialized tile grid, called as `tile_gemm`'s tile-grid kernel is (int32
    `expert_rows` of the tile experts first): -> bf16 [T, n_out, N], or with k_splits > 1 the fp32 partials
    [n_lin, k_splits, T, n_out, N] (unused tiles' rows undefined)."""
    from dsjax.kernels.moe_gemm.mosaic_fp4 import (QUAD, ROWS, kernel_refs, pair_rows_spec, store_unit,
                                                   unit_outputs, weight_block_spec)

    fp8, nb, n_lin, N = step_math.fp8, step_math.nb, step_math.n_lin, step_math.N
    C = consumers
    W, Q = block_k // 8, K // QUAD
    steps = K // block_k // k_splits
    split_out = k_splits > 1
    n_side = fp8 + 1 + C * n_lin                       # side copies a program: x scales, weights, row scales

    def body(e_ref, x_ref, *rest):
        xs_ref, pw_ref, w_refs, s_refs, out_ref, (e_s, xs_s, pw_s, sc_s, o_s, bars) = kernel_refs(rest, fp8, n_lin)
        t, r, split, wg = (lax.axis_index(a) for a in ("t", "r", "s", "wg"))
        memory = wg == C

        @pl.when(memory)
        def _expert():
            plgpu.copy_gmem_to_smem(e_ref.at[t], e_s, bars.at[0])
        plgpu.barrier_wait(bars.at[0])
        e = e_s[0]

        @pl.when(e >= 0)
        def _tile():
            @pl.when(memory)
            def _side_operands():
                copies = ([(xs_ref.at[t], xs_s)] if fp8 else []) + [(pw_ref.at[t], pw_s)] + [
                    (s_refs[j].at[e * (n_out // ROWS) + r * C + c], sc_s.at[c * n_lin + j])
                    for c in range(C) for j in range(n_lin)]
                for i, (src, dst) in enumerate(copies):     # a barrier each: one arrival per copy
                    plgpu.copy_gmem_to_smem(src, dst, bars.at[1 + i])

            rows = pl.multiple_of(wg * ROWS, ROWS)          # this consumer's rows of the program's C x 64

            def step(idx, x_step, *refs_and_carry):
                w_s, accs = refs_and_carry[:n_lin], refs_and_carry[-1]

                @pl.when(idx[0] == 0)
                def _wait_side_operands():
                    for i in range(n_side):
                        plgpu.barrier_wait(bars.at[1 + i])

                k = idx[0] + split * steps
                mine = [w.at[pl.ds(rows, ROWS)] for w in w_s]
                return step_math.fold(accs, k, x_step, mine,
                                      lambda j, q: step_math.scale_column(sc_s, wg * n_lin + j, q), xs_s)

            def compute(eval_pipeline):
                zeros = tuple(plgpu.layout_cast(jnp.zeros((ROWS, N), jnp.float32), plgpu.Layout.WGMMA)
                              for _ in range(n_lin))
                accs = eval_pipeline(zeros)
                store_unit(accs, o_s.at[wg], out_ref, pw_s, t=t, rows=pl.ds(r * C * ROWS + rows, ROWS),
                           split=split, split_out=split_out, swiglu_limit=swiglu_limit)
                plgpu.wait_smem_to_gmem(0)

            w_spec = weight_block_spec(W, lambda k: (e, r, split * steps + k), rows=C * ROWS)
            x_spec = pair_rows_spec(nb, N, row_bytes, lambda k: (t, split * steps + k, 0, 0))
            plgpu.emit_pipeline_warp_specialized(
                step, grid=(steps,), memory_registers=MEMORY_REGISTERS, in_specs=[x_spec] + [w_spec] * n_lin,
                max_concurrent_steps=stages, wg_axis="wg", num_compute_wgs=C, compute_context=compute)(
                    x_ref, *w_refs)

    out_type, o_tiles = unit_outputs(n_lin, k_splits, T, n_out, N, tiles=(C,))
    return plgpu.kernel(
        body, out_type=out_type,
        grid=(T, n_out // (C * ROWS), k_splits), grid_names=("t", "r", "s"),
        num_threads=C + 1, thread_name="wg",
        scratch_types=[
            plgpu.SMEM((4,), jnp.int32),                                            # the tile's expert
            plgpu.SMEM((Q if fp8 else 1, N), jnp.float32),                          # the pairs' x scales
            plgpu.SMEM((N,), jnp.float32),                                          # their routing weights
            plgpu.SMEM((C * n_lin, 4 * Q, 16), jnp.uint32),                         # each consumer's row scales
            o_tiles,                                                                # each consumer's output tile
            plgpu.Barrier(num_barriers=1 + n_side),
        ],
        interpret=interp)
