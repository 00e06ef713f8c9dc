"""The persistent launch of `mosaic_fp4.tile_gemm`: `programs` programs (one an SM), each streaming its share of
every used tile's units — (64-row block, K split) of one tile — through ONE weight pipeline.

Why (issue 8; docs/benchmarks.md, "The read ceiling of the kernels' shape"): the tile grid runs one program a unit.
At one token that is 192 programs of 16 serial steps on 132 SMs (60 SMs run two after each other), and every
program fills and drains its own pipeline, waits for its side operands and runs its epilogue with no weight load in
flight. Here a program's units follow each other in one pipeline: the next unit's weights stream in during this
unit's last steps and epilogue, and its side operands (the pairs' activation scales, pair weights, the rows' block
scales) load one unit ahead into the other of two buffers. Units are dealt out whole and evenly (program p takes
units [p·U / P, (p + 1)·U / P)), so no unit is cut between programs and none needs a fix-up: each unit's K is
folded by one program in the tile grid's order (`StepMath.fold`), and the outputs equal the tile grid's bit for
bit. At one token the up launch's 192 units (384 with `k_splits` 2) leave the busiest SM 2 (3) where the mean is
1.45 (2.9); at 8 tokens 1,440 units give 11 against 10.9.

Unused tiles (-1) take no step: `used_tiles` lists the used ones first (one small sort) with their count, which
the kernel reads before it splits the work.

Measured on an H100 (2026-12-05, docs/benchmarks.md "The persistent launch on an H100"): outputs bit-equal to the
tile grid's, but both GEMM kernels are slower (132 programs, 4 stages: up 33.3 vs 25.4 µs at one token, 160.3 vs
148.7 at 8; down 17.3 vs 13.2, 103.3 vs 77.6), so the launch stays opt-in (`programs` 0 is the tile grid). Not
the side operands, the in-pipeline stores or the reset (timing-only variants: 0-4%); two programs an SM recover much
of it, and with the FP4 decode its reads stay ahead, so likely one warpgroup's serial step (wgmma, its wait, the
scaled sums) bounds an SM here.
"""

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from dsjax.kernels.common import every_bit

SMS = 132           # the H100's and H200's SMs: one program each by default


def used_tiles(experts):
    """int32 [T] tile experts (-1 unused) -> int32 [T + 1, 4]: row i < n = (expert, tile) of the i-th used tile in
    tile order, row T = (n, ...); one 16-byte row a tile (TMA copies whole 16-byte rows)."""
    experts = experts.astype(jnp.int32)
    order = jnp.argsort(experts < 0, stable=True).astype(jnp.int32)
    rows = jnp.stack([experts[order], order], axis=1)
    count = jnp.sum(experts >= 0, dtype=jnp.int32)
    return jnp.pad(jnp.concatenate([rows, jnp.stack([count, jnp.int32(0)])[None]]), ((0, 0), (0, 2)))


def aligned(rows: int, row_words: int) -> int:
    """Rows of 4-byte words a buffer holds so that each of two side by side starts on 128 bytes. Mosaic issues these
    copies as tensor-map copies (`cp.async.bulk.tensor`, seen in the kernel's PTX), whose shared-memory destination
    must start on 128 bytes: the first version (parts 32 bytes apart for 8 pair weights) stopped on an H100 with a
    misaligned address; with this it runs, clean under compute-sanitizer's memcheck (docs/kernels.md)."""
    while rows * row_words * 4 % 128:
        rows += 1
    return rows


def side_buffers(fp8: bool, Q: int, N: int, n_lin: int):
    """(shape, dtype) of the side operands' shared-memory buffers, two units' worth each (leading axis): the pairs'
    x scales [Q rows of N], their routing weights [N], each Linear's rows' block scales [4Q, 16] words. Every
    unit's part starts on 128 bytes (`aligned`: a tensor-map copy's destination must)."""
    return [((2, aligned(Q if fp8 else 1, N), N), jnp.float32), ((2, aligned(N, 1)), jnp.float32),
            ((2 * n_lin, 4 * Q, 16), jnp.uint32)]


def _keep_unless(flag, acc):
    """acc with every bit cleared where flag (a scalar), else as it is: a unit's first step starts its sums from 0
    (a mask on the bits, not a product: a product keeps an inf or NaN of the unit before)."""
    keep = every_bit(jnp.logical_not(flag))
    return lax.bitcast_convert_type(lax.bitcast_convert_type(acc, jnp.uint32) & keep, jnp.float32)


def persistent_kernel(step_math, *, T: int, n_out: int, K: int, block_k: int, k_splits: int, stages: int,
                      programs: int, row_bytes: int, swiglu_limit, interp):
    """The `plgpu.kernel` of the persistent launch, called as `tile_gemm`'s tile-grid kernel is (the table of
    `used_tiles` in place of the tile experts): -> bf16 [T, n_out, N], or with k_splits > 1 the fp32 partials
    [n_lin, k_splits, T, n_out, N] (unused tiles' rows undefined)."""
    from dsjax.kernels.moe_gemm.mosaic_fp4 import (QUAD, ROWS, kernel_refs, pair_rows_spec, store_unit,
                                                   unit_outputs, weight_block_spec)

    fp8, nb, n_lin, N = step_math.fp8, step_math.nb, step_math.n_lin, step_math.N
    W, Q = block_k // 8, K // QUAD
    R, S = n_out // ROWS, K // block_k // k_splits           # row blocks a tile; steps a unit
    per_tile = R * k_splits                                  # units a tile
    n_side = fp8 + 1 + n_lin                                 # side copies a unit
    split_out = k_splits > 1

    def body(tab_ref, x_ref, *rest):
        xs_ref, pw_ref, w_refs, s_refs, out_ref, (tab_s, xs_s, pw_s, sc_s, o_s, bars) = kernel_refs(rest, fp8, n_lin)
        p = lax.axis_index("p")
        plgpu.copy_gmem_to_smem(tab_ref, tab_s, bars.at[0])
        plgpu.barrier_wait(bars.at[0])
        units = tab_s[T, 0] * per_tile
        first = p * units // programs
        n_units = (p + 1) * units // programs - first

        def unit(lu):
            """Local unit lu -> (expert, tile, row block, K split)."""
            u = first + lu
            j = u // per_tile
            return tab_s[j, 0], tab_s[j, 1], u // k_splits % R, u % k_splits

        def side_copies(lu, buf: int):
            e, t, r, _ = unit(lu)
            copies = ([(xs_ref.at[t], xs_s.at[buf, pl.ds(0, Q)])] if fp8 else []) + [
                (pw_ref.at[t], pw_s.at[buf, pl.ds(0, N)])] + [
                (s_refs[j].at[e * R + r], sc_s.at[buf * n_lin + j]) for j in range(n_lin)]
            for i, (src, dst) in enumerate(copies):          # a barrier each: one arrival per copy
                plgpu.copy_gmem_to_smem(src, dst, bars.at[1 + buf * n_side + i])

        def on_buffer(buf, fn):
            """fn(b) for the static b == buf (barrier and buffer indices stay static)."""
            for b in range(2):
                pl.when(buf == b)(lambda b=b: fn(b))

        def index_of(i):
            e, t, r, s = unit(i // S)
            return e, t, r, s * S + i % S

        def weight_map(i):
            e, _, r, k = index_of(i)
            return e, r, k

        def x_map(i):
            _, t, _, k = index_of(i)
            return t, k, 0, 0

        def step(idx, *refs_and_carry):
            x_step, w_s, accs = refs_and_carry[0], refs_and_carry[1:1 + n_lin], refs_and_carry[1 + n_lin]
            i = idx[0]
            lu, kk = i // S, i % S
            buf = lu % 2

            @pl.when(kk == 0)
            def _unit_start():
                @pl.when(lu + 1 < n_units)
                def _next_side_operands():                   # into the buffer the unit before this one used
                    on_buffer(1 - buf, lambda b: side_copies(lu + 1, b))

                def wait_side_operands(b):
                    for c in range(n_side):
                        plgpu.barrier_wait(bars.at[1 + b * n_side + c])
                on_buffer(buf, wait_side_operands)

            _, t, r, s = unit(lu)
            accs = tuple(_keep_unless(kk == 0, a) for a in accs)
            new = step_math.fold(accs, s * S + kk, x_step, w_s,
                                 lambda j, q: step_math.scale_column(sc_s, buf * n_lin + j, q), xs_s.at[buf])

            @pl.when(kk == S - 1)
            def _unit_end():
                rows = pl.ds(r * ROWS, ROWS)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the last unit's store has read o_s
                store_unit(new, o_s, out_ref, pw_s.at[buf, pl.ds(0, N)], t=t, rows=rows, split=s,
                           split_out=split_out, swiglu_limit=swiglu_limit)
            return new

        @pl.when(n_units > 0)
        def _work():
            side_copies(0, 0)
            w_spec = weight_block_spec(W, weight_map)
            x_spec = pair_rows_spec(nb, N, row_bytes, x_map)
            zeros = tuple(plgpu.layout_cast(jnp.zeros((ROWS, N), jnp.float32), plgpu.Layout.WGMMA)
                          for _ in range(n_lin))
            plgpu.emit_pipeline(step, grid=(n_units * S,), in_specs=[x_spec] + [w_spec] * n_lin,
                                max_concurrent_steps=stages, init_carry=zeros)(x_ref, *w_refs)
            plgpu.wait_smem_to_gmem(0)

    out_type, o_tile = unit_outputs(n_lin, k_splits, T, n_out, N)
    return plgpu.kernel(
        body, out_type=out_type,
        grid=(programs,), grid_names=("p",),
        scratch_types=[
            plgpu.SMEM((T + 1, 4), jnp.int32),                                      # the used tiles, their count
            *[plgpu.SMEM(shape, dtype) for shape, dtype in side_buffers(fp8, Q, N, n_lin)],
            o_tile,                                                                 # the output tile
            plgpu.Barrier(num_barriers=1 + 2 * n_side),
        ],
        interpret=interp)
