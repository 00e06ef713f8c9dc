"""Chunk attention on Hopper tensor cores through Mosaic GPU (`plgpu.kernel`, wgmma): one block per 64 query rows,
two compute warpgroups that split the head dimension of the output, one TMA producer warpgroup.

Why the split: V4 heads are 512 wide, and a [64, 512] fp32 output accumulator is 256 registers a thread — more than
a warpgroup has. So warpgroup w owns dims [w·d/2, (w+1)·d/2) of the output: O_w += P·V_w on its half of every key
tile (K = V). The scores need all of d. By default (`exchange_buffers=0`) each warpgroup computes the whole Q·Kᵀ
[64, block_k] itself, over both halves of Q and of the key tile: 1.5x the tensor-core work of a tile, but the two
warpgroups never wait for each other inside the key loop, so one's softmax runs under the other's wgmma (H200,
2026-12-05: 12% faster than exchanging partial scores for HCA at 1M, 1-8% elsewhere: docs/benchmarks.md). The
alternative, each warpgroup's partial scores Q_w·K_wᵀ summed through shared memory (16 KB for 64 x 64 fp32, one
buffer taken in turns, or one per warpgroup: `exchange_buffers` 1 / 2), does no tensor-core work twice but makes
both warpgroups meet twice a tile and idle the tensor cores together during the exchange and the softmax (fp32
addition commutes, so both hold the same scores). The template kernel in
jax.experimental.pallas.ops.gpu.attention_mgpu gives each warpgroup whole rows, which fits ≤ 256-wide heads only. A
tile that every row of the program sees whole (most of a long HCA cache) skips the visibility mask (H200,
2026-12-05: HCA over a 1M cache 3,605 -> 2,703 µs, 52.5% of the matmul rate). The producer walks the program's
visible key blocks (the same XLA-computed block ranges as the Triton kernel, `rows.chunk_rows`) and keeps `stages`
tiles in flight, each with its lo / hi visibility bounds.

Numerics are the Triton kernel's (`common.online_softmax`, as in `flash_step`): fp32 scores, p rounded to the compute dtype against the
running max before P·V, fp32 accumulation. Without picks the kernel divides by the sum plus the sink and writes
the output; with CSA picks it writes m, l and acc / l rounded to the compute dtype (shared memory has no room for
a [64, 512] fp32 tile beside the key stages: one extra rounding of 2^-9 relative), which `rows.merge_picks`
combines with the picks' partials.

With `overlap_qk` (and an exchange) each warpgroup issues the next key tile's Q·Kᵀ before it exchanges and
softmaxes this one, and that wgmma retires with P·V's wait: FlashAttention-3's intra-warpgroup overlap, here also
hiding the rendezvous. Opt-in: the H200 timed it 1.48x slower than the one-buffer exchange at hca@128k
(docs/benchmarks.md, issue 9 item 9).

In Mosaic GPU interpret mode (CPU tests) P·V is a dot of the loaded values: the interpreter has no `pl.run_state`,
which the wgmma-into-a-register-accumulator form needs on the GPU; the lowering itself is tested for CUDA.
"""

import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from dsjax.kernels.chunk_attention.rows import chunk_rows, merge_picks
from dsjax.kernels.common import check_offsets, gpu_interpret, online_softmax, pad_axis, wgmma_smem

ROWS = 64              # a warpgroup's wgmma M: one program's query rows
COMPUTE_WGS = 2        # each owns half of the head dimension


def _pv(acc, p, v_ref, interpreting: bool):
    """acc + p · v (fp32 accumulation) on the tensor cores; a plain dot in the interpreter (no pl.run_state)."""
    if interpreting:
        return acc + jnp.dot(p, v_ref[...], preferred_element_type=jnp.float32)

    def pv(acc_ref):
        plgpu.wgmma(acc_ref, p, v_ref)
    return pl.run_state(pv)(plgpu.ACC.init(acc))


def _load_if(pred, ref, shape, layout):
    """ref's fp32 tile where pred holds, else zeros (the same layout either way)."""
    return lax.cond(pred, lambda: plgpu.load(ref, layout=layout),
                    lambda: plgpu.layout_cast(jnp.zeros(shape, jnp.float32), layout))


def _block_of(steps_s, i, n_segments: int):
    """Key block of step i: the steps walk segment 0's range [first, first + count), then segment 1's, ...
    (steps_s = [total, first_0, count_0, first_1, count_1, ...])."""
    blk, offset = steps_s[1], jnp.int32(0)
    for s in range(n_segments):
        first, count = steps_s[1 + 2 * s], steps_s[2 + 2 * s]
        blk = jnp.where((i >= offset) & (i < offset + count), first + i - offset, blk)
        offset = offset + count
    return blk


def _check_interpreter_threads():
    """Interpret mode runs the three warpgroups as threads that block in barrier callbacks, on XLA:CPU's pool of
    NPROC (default: the cores) threads: with fewer than three, two waiting warpgroups starve the third and the call
    never returns. Refuse instead of hanging."""
    pool = int(os.environ.get("NPROC") or len(os.sched_getaffinity(0)))
    if pool < COMPUTE_WGS + 1:
        raise RuntimeError(f"the Mosaic GPU chunk attention kernel in interpret mode needs ≥ {COMPUTE_WGS + 1} XLA:CPU "
                           f"threads, this process has {pool}: start it with NPROC=8 in the environment (before JAX "
                           "starts), or use backend=\"triton\" / implementation=\"xla\" off-GPU")


def step_table(ranges):
    """[B, P, 2·nseg] absolute [first, last) blocks -> [B, P, 4k] int32: total steps, then (first, count) per
    segment, zero-padded to 16 bytes (a TMA row)."""
    first, last = ranges[..., 0::2], ranges[..., 1::2]
    count = last - first
    table = jnp.concatenate([count.sum(-1, keepdims=True), jnp.stack([first, count], -1).reshape(
        ranges.shape[:2] + (-1,))], axis=-1)
    return pad_axis(table.astype(jnp.int32), 2, 4, 0)


def chunk_attention(q, q_pos, sink, segments, picks, *, scale: float, row_format, block_k: int = 64,
                    stages: int = 2, exchange_buffers: int = 0, overlap_qk: bool = False, interpret=None):
    """`exchange_buffers`: 1 — the two warpgroups take one partial-score buffer in turns (two rendezvous a key
    tile); 2 — each writes its own buffer, one rendezvous, and a warpgroup waits only before overwriting its buffer
    until the other has read it (its QK of the next tile usually covers that). Two buffers take 16 KB more shared
    memory: they fit beside one stage of 64-key tiles only (two stages need 236,672 B, the H200 has 232,448).
    0 — no exchange: each warpgroup computes the whole Q·Kᵀ over both halves itself (1.5x the tensor-core work of
    a tile) and the two never meet inside the key loop, so one's softmax can run under the other's wgmma (the
    warpgroup ping-pong of FlashAttention-3, left to the hardware's scheduling); they meet once, before the
    output overwrites Q.
    `overlap_qk`: issue the next key tile's Q·Kᵀ before this tile's exchange and softmax (FlashAttention-3's
    intra-warpgroup overlap; one more [64, block_k] fp32 accumulator a thread); needs ≥ 2 stages (the next tile
    must be in another slot while this one is read)."""
    B, T, H, d = q.shape
    dt = q.dtype
    if d % (COMPUTE_WGS * 64):
        raise ValueError(f"head_dim {d} must split into {COMPUTE_WGS} halves of a multiple of 64 (128-byte rows)")
    if block_k % 64:
        # P·V's K is block_k; V's half tiles have 128-byte rows, whose swizzle makes wgmma take K in groups of 64
        raise ValueError(f"block_k {block_k} must be a multiple of 64 (the wgmma K group of P·V)")
    if stages < 1:
        raise ValueError(f"stages {stages} must be ≥ 1")
    if exchange_buffers not in (0, 1, 2):
        raise ValueError(f"exchange_buffers {exchange_buffers} must be 0, 1 or 2")
    if overlap_qk and stages < 2:
        raise ValueError(f"overlap_qk needs ≥ 2 stages (the next key tile in its own slot), got {stages}")
    if overlap_qk and not exchange_buffers:
        raise ValueError("overlap_qk hides the exchange: it needs exchange_buffers 1 or 2")
    double = exchange_buffers == 2
    whole_qk = exchange_buffers == 0
    dh = d // COMPUTE_WGS
    cr = chunk_rows(q, q_pos, sink, segments, row_format, ROWS, block_k)
    R = cr.q.shape[1]
    P = R // ROWS
    n_seg = len(segments)
    steps = step_table(cr.ranges)
    lohi = jnp.stack([cr.lo, cr.hi], axis=1)                                                   # [B, 2, N]
    finalize = picks is None
    interp = gpu_interpret(interpret)
    interpreting = interp not in (None, False)
    if interpreting:
        _check_interpreter_threads()
    ROW, COL, TILE = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0), plgpu.Layout.WGMMA

    def body(q_ref, pos_ref, sink_ref, kv_ref, lohi_ref, steps_ref, *rest):
        outs = rest[:1 if finalize else 3]
        (q_s, k_s, lohi_s, x_s, pos_s, sink_s, steps_s, ml_s,
         q_bars, k_bars, lohi_bars, consumed, meet, misc_bars, read_bars) = rest[len(outs):]
        b, p, wg = lax.axis_index("b"), lax.axis_index("p"), lax.axis_index("wg")
        mine = pl.ds(p * ROWS, ROWS)

        def rendezvous():
            plgpu.barrier_arrive(meet)
            plgpu.barrier_wait(meet)

        @pl.when(wg == COMPUTE_WGS)
        def _producer():
            plgpu.set_max_registers(40, action="decrease")
            plgpu.copy_gmem_to_smem(steps_ref.at[b, p], steps_s, misc_bars.at[0])
            plgpu.copy_gmem_to_smem(pos_ref.at[b, mine], pos_s, misc_bars.at[1])
            plgpu.copy_gmem_to_smem(sink_ref.at[mine], sink_s, misc_bars.at[2])
            plgpu.barrier_wait(misc_bars.at[0])
            n = steps_s[0]

            def issue(i, slot):
                keys = pl.ds(_block_of(steps_s, i, n_seg) * block_k, block_k)
                for h in range(COMPUTE_WGS):
                    plgpu.copy_gmem_to_smem(kv_ref.at[b, keys, pl.ds(h * dh, dh)], k_s.at[slot, h],
                                            k_bars.at[slot * COMPUTE_WGS + h])
                plgpu.copy_gmem_to_smem(lohi_ref.at[b, :, keys], lohi_s.at[slot], lohi_bars.at[slot])

            for i in range(stages):
                pl.when(i < n)(lambda i=i: issue(i, i))

            @pl.loop(0, jnp.maximum(n - stages, 0))
            def _refill(i):
                slot = lax.rem(i, stages)
                plgpu.barrier_wait(consumed.at[slot])
                issue(i + stages, slot)

            @pl.loop(jnp.maximum(n - stages, 0), n)
            def _drain(i):          # observe every phase of the slot barriers (the interpreter checks it)
                plgpu.barrier_wait(consumed.at[lax.rem(i, stages)])

        @pl.when(wg < COMPUTE_WGS)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            plgpu.copy_gmem_to_smem(q_ref.at[b, mine, pl.ds(wg * dh, dh)], q_s.at[wg], q_bars.at[wg])
            for i in range(3):
                plgpu.barrier_wait(misc_bars.at[i])
            halves = range(COMPUTE_WGS) if whole_qk else (wg,)     # the Q and key halves my Q·Kᵀ reads
            for h in halves:
                plgpu.barrier_wait(q_bars.at[h])
            n = steps_s[0]
            pos = plgpu.load(pos_s, layout=ROW)
            first_pos, last_pos = pos_s[0], pos_s[ROWS - 1]        # rows ascend in position
            shape = (ROWS, block_k)
            row_pos = lax.broadcast_in_dim(pos, shape, [0])

            def qk_into(acc_ref, slot):
                for h in halves:        # whole: both halves, into one accumulator
                    plgpu.wgmma(acc_ref, q_s.at[h], k_s.at[slot, h].transpose((1, 0)))

            def scores(slot):
                """This warpgroup's partial Q·Kᵀ of the tile in `slot`, waited for."""
                def qk(acc_ref):
                    qk_into(acc_ref, slot)
                    return acc_ref[...]
                return pl.run_scoped(qk, plgpu.ACC(shape, jnp.float32))

            def exchange(i, part):
                """The other warpgroup's partial scores of this tile, through shared memory."""
                if double:
                    # my buffer is free once the other warpgroup has read the previous tile's partial from it
                    pl.when(i > 0)(lambda: plgpu.barrier_wait(read_bars.at[wg]))
                    x_s.at[wg][...] = part
                    rendezvous()
                    other = plgpu.load(x_s.at[1 - wg], layout=TILE)
                    plgpu.barrier_arrive(read_bars.at[1 - wg])
                    return other
                # One exchange buffer: warpgroup 0 writes its partial, 1 reads it and writes its own, 0 reads
                # that; each takes zeros at the other's turn.
                x0 = x_s.at[0]
                pl.when(wg == 0)(lambda: x0.__setitem__(Ellipsis, part))
                rendezvous()
                other = _load_if(wg == 1, x0, shape, TILE)      # warpgroup 1: the partial of 0
                pl.when(wg == 1)(lambda: x0.__setitem__(Ellipsis, part))
                rendezvous()
                return other + _load_if(wg == 0, x0, shape, TILE)   # warpgroup 0: the partial of 1 (x + 0 = x)

            def finish(slot, part, other, acc, m, l):
                """Scores -> online softmax -> acc += P·V_half; the key slot handed back to the producer."""
                plgpu.barrier_wait(lohi_bars.at[slot])
                s = (part if other is None else part + other) * scale

                def masked():
                    lo = lax.broadcast_in_dim(plgpu.load(lohi_s.at[slot, 0], layout=COL), shape, [1])
                    hi = lax.broadcast_in_dim(plgpu.load(lohi_s.at[slot, 1], layout=COL), shape, [1])
                    return online_softmax(m, l, s, (lo <= row_pos) & (row_pos < hi))

                # lo / hi ascend within a tile (segments are padded to whole tiles): the tile is visible to every
                # row when its last lo and first hi admit the first and the last row; most tiles of a long
                # cache are, and skip the mask
                whole = (lohi_s[slot, 0, block_k - 1] <= first_pos) & (last_pos < lohi_s[slot, 1, 0])
                m_new, alpha, pr, l = lax.cond(whole, lambda: online_softmax(m, l, s, None), masked)
                acc = _pv(acc * lax.broadcast_in_dim(alpha, acc.shape, [0]), pr.astype(dt), k_s.at[slot, wg],
                          interpreting)
                # the slot's lo / hi were read by generic loads and the producer's TMA (the async proxy) will
                # overwrite them: a proxy fence first (the interpreter's race detector flagged the refill without it)
                plgpu.commit_smem()
                plgpu.barrier_arrive(consumed.at[slot])
                return acc, m_new, l

            def tile(i, carry):
                acc, m, l = carry
                slot = lax.rem(i, stages)
                for h in halves:
                    plgpu.barrier_wait(k_bars.at[slot * COMPUTE_WGS + h])
                part = scores(slot)
                return finish(slot, part, None if whole_qk else exchange(i, part), acc, m, l)

            def overlapped_tile(i, carry):
                """Tile i with tile i + 1's Q·Kᵀ issued first and left in flight through the exchange, the
                softmax and up to P·V (whose wait retires it): the tensor cores are not idle while the two
                warpgroups meet. The last tile issues its own Q·Kᵀ again (its slot is still held), so the
                schedule has no branch around a wgmma."""
                acc, m, l, part = carry
                slot = lax.rem(i, stages)
                nslot = lax.rem(jnp.minimum(i + 1, n - 1), stages)
                pl.when(i + 1 < n)(lambda: plgpu.barrier_wait(k_bars.at[nslot * COMPUTE_WGS + wg]))

                def scope(next_ref):
                    qk_into(next_ref, nslot)
                    acc2, m2, l2 = finish(slot, part, exchange(i, part), acc, m, l)
                    return acc2, m2, l2, next_ref[...]
                return pl.run_scoped(scope, plgpu.ACC(shape, jnp.float32))

            init = (plgpu.layout_cast(jnp.zeros((ROWS, dh), jnp.float32), TILE),
                    plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), ROW),
                    plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), ROW))
            if overlap_qk:
                # tile 0's scores first (with no visible block, slot 0 is read but never used)
                pl.when(n > 0)(lambda: plgpu.barrier_wait(k_bars.at[wg]))
                acc, m, l, _ = lax.fori_loop(0, n, overlapped_tile, init + (scores(0),))
            else:
                acc, m, l = lax.fori_loop(0, n, tile, init)
            if double:      # observe the last tile's read (every barrier phase is waited on)
                pl.when(n > 0)(lambda: plgpu.barrier_wait(read_bars.at[wg]))
            if whole_qk:    # the other warpgroup reads my Q half until its last Q·Kᵀ; my output overwrites it
                rendezvous()
            m_safe = jnp.where(m == -jnp.inf, 0.0, m)
            if finalize:
                denom = l + jnp.exp(plgpu.load(sink_s, layout=ROW) - m_safe)
            else:
                denom = jnp.where(l > 0, l, 1.0)
            q_s.at[wg][...] = (acc / lax.broadcast_in_dim(denom, acc.shape, [0])).astype(dt)
            if not finalize:
                @pl.when(wg == 0)
                def _stats():
                    ml_s.at[0][...] = m
                    ml_s.at[1][...] = l
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_s.at[wg], outs[0].at[b, mine, pl.ds(wg * dh, dh)])
            if not finalize:
                @pl.when(wg == 0)
                def _write_stats():
                    plgpu.copy_smem_to_gmem(ml_s.at[0], outs[1].at[b, mine])
                    plgpu.copy_smem_to_gmem(ml_s.at[1], outs[2].at[b, mine])
            plgpu.wait_smem_to_gmem(0)

    f32 = jnp.float32
    out_type = [jax.ShapeDtypeStruct((B, R, d), dt)]
    if not finalize:
        out_type += [jax.ShapeDtypeStruct((B, R), f32)] * 2
    check_offsets("chunk_attention_mosaic", cr.q, cr.row_pos, cr.row_sink, cr.kv, lohi, steps)
    kernel = plgpu.kernel(
        body, out_type=tuple(out_type), grid=(B, P), grid_names=("b", "p"),
        num_threads=COMPUTE_WGS + 1, thread_name="wg",
        scratch_types=[
            wgmma_smem((COMPUTE_WGS, ROWS, dh), dt),                      # Q halves, then the output halves
            wgmma_smem((stages, COMPUTE_WGS, block_k, dh), dt),           # key tiles (K = V), by half
            plgpu.SMEM((stages, 2, block_k), jnp.int32),                  # their lo / hi
            plgpu.SMEM((exchange_buffers, ROWS, block_k) if exchange_buffers else (1, 1), f32),  # partial scores
            plgpu.SMEM((ROWS,), jnp.int32), plgpu.SMEM((ROWS,), f32),     # row positions, row sinks
            plgpu.SMEM((steps.shape[-1],), jnp.int32), plgpu.SMEM((2, ROWS), f32),   # step table; m, l out
            plgpu.Barrier(num_barriers=COMPUTE_WGS),
            plgpu.Barrier(num_barriers=stages * COMPUTE_WGS),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),  # a key slot is free again
            plgpu.Barrier(num_arrivals=COMPUTE_WGS),                       # the partial-score rendezvous
            plgpu.Barrier(num_barriers=3),
            plgpu.Barrier(num_barriers=COMPUTE_WGS),                       # the other has read my partial
        ],
        interpret=interp,
    )
    outs = kernel(cr.q, cr.row_pos, cr.row_sink, cr.kv, lohi, steps)
    if finalize:
        return outs[0][:, :cr.rows].reshape(B, T, H, d)
    o, m, l = outs
    # the picks' partials come from the Triton sparse MQA kernel: its interpret flag is a bool
    triton_interp = None if interpret is None else bool(interpret)
    return merge_picks(m, l, o.astype(f32) * l[..., None], q, sink, picks, row_format, scale, triton_interp)
