"""Block-sparse flash attention over shared key segments, lowered through Triton: one program per block of
`block_q` query rows.

MQA makes the rows cheap to share: q [B, T, H, d] is read as [B, T·H, d] rows (token-major), and every row of a
program scores the same key tile, so a tile of `block_k` keys serves block_q dot products per key on the tensor
cores. A program walks, per segment, only the key blocks that some of its rows can see (host-free: the ranges are
searched in XLA from the segments' sorted lo / hi by `rows.chunk_rows`, and passed as loop bounds), masks each tile with
lo <= position < hi, and keeps an online softmax. Without picks it divides by the sum plus the sink and writes
the output; with CSA picks it writes its partials for the sparse MQA kernel's combine.

Shared rows are read many times (by every program whose rows see them), so compact FP8 rows are dequantised once
in XLA (W + T + N rows a layer: small) and the kernel loads whole [rows, d] bf16 tiles: contiguous, vectorised,
one dot per tile. (The first version gathered compact rows byte by byte in the kernel, as the sparse MQA kernel
does for its per-query lists: 3x slower on the H200.)

Triton was the first backend because the online softmax is the sparse MQA kernel's (`dsjax.kernels.common`) and
the tile masks are iota compares; at 512-wide heads it keeps a [block_q, 512] fp32 accumulator in registers, which
caps block_q at 64 (docs/benchmarks.md). `pallas_gpu.py` is the Mosaic GPU (wgmma) kernel over the same rows.
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dsjax.kernels.chunk_attention.rows import chunk_rows, merge_picks
from dsjax.kernels.common import (check_offsets, flash_init, flash_scores, flash_step, gather, triton_interpret,
                                  triton_params)


def chunk_attention(q, q_pos, sink, segments, picks, *, scale: float, row_format, block_q: int = 64,
                    block_k: int = 64, num_warps: int = 8, num_stages: int = 2, interpret=None):
    """Defaults as the sparse MQA kernel's H200 sweep winner (64 rows x 64 keys, 8 warps)."""
    B, T, H, d = q.shape
    dt = q.dtype
    cr = chunk_rows(q, q_pos, sink, segments, row_format, block_q, block_k)
    q2, row_pos, row_sink, kv, lo, hi, ranges = cr.q, cr.row_pos, cr.row_sink, cr.kv, cr.lo, cr.hi, cr.ranges
    rows, P = cr.rows, cr.q.shape[1] // block_q
    finalize = picks is None

    def body(q_ref, pos_ref, sink_ref, kv_ref, lo_ref, hi_ref, rng_ref, *out_refs):
        b, p = pl.program_id(0), pl.program_id(1)
        mine = pl.ds(p * block_q, block_q)
        pos = pos_ref[b, mine]
        qs = [q_ref[b, mine, :]]

        def tile(kb, carry):
            keys = pl.ds(kb * block_k, block_k)
            ok = (lo_ref[b, keys][None, :] <= pos[:, None]) & (pos[:, None] < hi_ref[b, keys][None, :])
            k = [kv_ref[b, keys, :].astype(dt)]
            return flash_step(carry, flash_scores(qs, k, scale), ok, k, dt)

        carry = flash_init(block_q, 1, d)
        for s in range(len(segments)):
            col = jnp.int32(2 * s)                         # an array index: all indexers must be arrays
            carry = jax.lax.fori_loop(gather(rng_ref, b, p, col), gather(rng_ref, b, p, col + 1), tile, carry)
        m, l, (acc,) = carry
        if finalize:
            (o_ref,) = out_refs
            m_safe = jnp.where(m == -jnp.inf, 0.0, m)
            o_ref[b, mine, :] = (acc / (l + jnp.exp(sink_ref[mine] - m_safe))[:, None]).astype(o_ref.dtype)
        else:
            m_ref, l_ref, acc_ref = out_refs
            m_ref[b, mine] = m
            l_ref[b, mine] = l
            acc_ref[b, mine, :] = acc

    R = q2.shape[1]
    f32 = jnp.float32
    out_shape = ((jax.ShapeDtypeStruct((B, R, d), dt),) if finalize else
                 (jax.ShapeDtypeStruct((B, R), f32), jax.ShapeDtypeStruct((B, R), f32),
                  jax.ShapeDtypeStruct((B, R, d), f32)))
    check_offsets("chunk_attention", q2, row_pos, row_sink, kv, lo, hi, ranges)
    outs = pl.pallas_call(
        body, out_shape=out_shape, grid=(B, P),
        compiler_params=triton_params(num_warps, num_stages),
        interpret=triton_interpret(interpret),
        name="chunk_attention",
    )(q2, row_pos, row_sink, kv, lo, hi, ranges)
    if finalize:
        return outs[0][:, :rows].reshape(B, T, H, d)
    return merge_picks(*outs, q, sink, picks, row_format, scale, interpret)
