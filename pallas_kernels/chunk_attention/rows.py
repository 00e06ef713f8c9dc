"""The kernels' view of a chunk: the queries as token-major rows, every segment's keys in one padded array, and
per program of `block_q` rows the key blocks it must visit — computed once in XLA, shared by the Triton and the
Mosaic GPU kernels. Also the CSA tail: the kernel's partials merged with the picks' through the flash combine."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dsjax.kernels.chunk_attention.api import NEVER
from dsjax.kernels.common import load_rows, pad_axis, row_width
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


@dataclasses.dataclass(frozen=True)
class ChunkRows:
    """q [B, R, d] (R = T·H padded to block_q), row_pos int32 [B, R], row_sink fp32 [R], the segments' keys as
    one kv [B, N, d] (each segment padded to block_k) with lo / hi int32 [B, N], and ranges int32 [B, P, 2·nseg]:
    per program and segment its absolute [first, last) key blocks."""
    q: jax.Array
    row_pos: jax.Array
    row_sink: jax.Array
    kv: jax.Array
    lo: jax.Array
    hi: jax.Array
    ranges: jax.Array
    rows: int                      # T·H: the real rows before padding


def chunk_rows(q, q_pos, sink, segments, row_format, block_q: int, block_k: int) -> ChunkRows:
    """Shared key rows are read by many programs, so compact FP8 rows are dequantised once here (W + T + N rows
    a layer: small) and the kernels load whole bf16 tiles."""
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
    ranges = []
    for base, l_, h_ in zip(bases, los, his):
        kb0, kb1 = block_ranges(row_pos, l_, h_, block_q, block_k)
        ranges += [kb0 + base, kb1 + base]
    ranges = jnp.stack(ranges, axis=-1).astype(jnp.int32)                                      # [B, P, 2·nseg]
    row_sink = jnp.tile(sink.astype(jnp.float32), (q2.shape[1] + H - 1) // H)[: q2.shape[1]]
    return ChunkRows(q2, row_pos, row_sink, kv, lo, hi, ranges, rows)


def merge_picks(m, l, acc, q, sink, picks, row_format, scale: float, interpret):
    """Rows' partials m, l [B, R] and acc [B, R, d] (fp32, padded rows included) merged with the CSA picks'
    partials (the sparse MQA kernel's) by the flash combine: [B, T, H, d] in q.dtype."""
    B, T, H, d = q.shape
    rows = T * H
    m, l, acc = m[:, :rows], l[:, :rows], acc[:, :rows]
    parts = [(m.reshape(B, T, 1, H), l.reshape(B, T, 1, H), acc.reshape(B, T, 1, H, d))]
    parts.append(sparse_pallas.partials(q, picks[0], picks[1], row_format, scale, interpret=interpret))
    stacked = tuple(jnp.concatenate(x, axis=2) for x in zip(*parts))
    return combine(stacked, sink.astype(jnp.float32), q.dtype)
