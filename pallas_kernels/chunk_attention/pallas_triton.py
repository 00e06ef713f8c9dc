"""Block-sparse flash attention over shared key segments, lowered through Triton: one program per block of
`block_q` query rows.

MQA makes the rows cheap to share: q [B, T, H, d] is read as [B, T·H, d] rows (token-major), and every row of a
program scores the same key tile, so a tile of `block_k` keys serves block_q dot products per key on the tensor
cores. A program walks, per segment, only the key blocks that some of its rows can see (host-free: the ranges are
searched in XLA from the segments' sorted lo / hi, and passed as loop bounds), masks each tile with
lo <= position < hi, and keeps an online softmax. Without picks it divides by the sum plus the sink and writes
the output; with CSA picks it writes its partials for the sparse MQA kernel's combine.

Shared rows are read many times (by every program whose rows see them), so compact FP8 rows are dequantised once
in XLA (W + T + N rows a layer: small) and the kernel loads whole [rows, d] bf16 tiles: contiguous, vectorised,
one dot per tile. (The first version gathered compact rows byte by byte in the kernel, as the sparse MQA kernel
does for its per-query lists: 3x slower on the H200.)

Triton rather than Mosaic GPU: the online softmax is the sparse MQA kernel's (`dsjax.kernels.common`), and the
tile masks are iota compares.
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dsjax.kernels.chunk_attention.api import NEVER
from dsjax.kernels.common import (check_offsets, flash_init, flash_scores, flash_step, gather, load_rows, pad_axis,
                                  row_width, triton_interpret, triton_params)
from dsjax.kernels.sparse_mqa import pallas_triton as sparse_pallas
from dsjax.kernels.sparse_mqa.xla import combine


def block_ranges(row_pos, lo, hi, block_q: int, block_k: int):
    """Per program of block_q rows: [first, last) key blocks holding every key some row sees. Rows are ascending
    in position, lo / hi nondecreasing: visible keys satisfy hi > first row's position and lo <= last row's."""
    first, last = row_pos[:, ::block_q], row_pos[:, block_q - 1::block_q]                     # [B, P]
    begin = jax.vmap(lambda h, p: jnp.searchsorted(h, p, side="right"))(hi, first)
    end = jax.vmap(lambda l, p: jnp.searchsorted(l, p, side="right"))(lo, last)
    kb0 = begin // block_k
    return kb0, jnp.maximum(kb0, -(-end // block_k))


def chunk_attention(q, q_pos, sink, segments, picks, *, scale: float, row_format, block_q: int = 64,
                    block_k: int = 64, num_warps: int = 8, num_stages: int = 2, interpret=None):
    """Defaults as the sparse MQA kernel's H200 sweep winner (64 rows x 64 keys, 8 warps)."""
    B, T, H, d = q.shape
    dt = q.dtype
    kvs, los, his, bases = [], [], [], []
    n = 0
    for seg in segments:
        assert row_width(seg.kv, row_format) == d, (seg.kv.shape, row_format, d)
        kvs.append(pad_axis(load_rows(seg.kv, row_format).astype(dt) if seg.kv.dtype == jnp.uint8 else seg.kv,
                            1, block_k, 0))
        los.append(pad_axis(seg.lo, 1, block_k, NEVER))
        his.append(pad_axis(seg.hi, 1, block_k, NEVER))
        bases.append(n // block_k)
        n += kvs[-1].shape[1]
    kv, lo, hi = (jnp.concatenate(x, axis=1) for x in (kvs, los, his))

    rows = T * H
    q2 = pad_axis(q.reshape(B, rows, d), 1, block_q, 0)
    row_pos = jnp.repeat(q_pos.astype(jnp.int32), H, axis=1)
    row_pos = jnp.pad(row_pos, ((0, 0), (0, q2.shape[1] - rows)), mode="edge")
    P = q2.shape[1] // block_q
    ranges = []
    for base, l_, h_ in zip(bases, los, his):
        kb0, kb1 = block_ranges(row_pos, l_, h_, block_q, block_k)
        ranges += [kb0 + base, kb1 + base]
    ranges = jnp.stack(ranges, axis=-1).astype(jnp.int32)                                      # [B, P, 2·nseg]
    row_sink = jnp.tile(sink.astype(jnp.float32), (q2.shape[1] + H - 1) // H)[: q2.shape[1]]
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
    m, l, acc = (x[:, :rows] for x in outs)
    parts = [(m.reshape(B, T, 1, H), l.reshape(B, T, 1, H), acc.reshape(B, T, 1, H, d))]
    parts.append(sparse_pallas.partials(q, picks[0], picks[1], row_format, scale, interpret=interpret))
    stacked = tuple(jnp.concatenate(x, axis=2) for x in zip(*parts))
    return combine(stacked, sink.astype(jnp.float32), dt)
