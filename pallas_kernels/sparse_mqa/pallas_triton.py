"""Flash-decoding over gathered keys, lowered through Triton: one program per (query row, head block, key split).

A program holds `head_block` heads of one query (all heads share the key, so every gathered row serves that many
dot products on the tensor cores), walks its split of the key list `block_k` rows at a time — one masked pointer
gather per row piece, straight from the stored layout (compact FP8 rows are dequantised in registers; -1 entries
read nothing) — and keeps an online softmax (max, sum, acc). The partials of every split are merged by
`xla.combine`, which adds the sink; splitting the keys lets long HCA lists (262k entries at 1M context) fill the
GPU at batch 1. Triton rather than Mosaic GPU: Hopper's TMA cannot gather rows, and wgmma needs the gathered tile
restaged into swizzled shared memory, which Triton's `tl.dot` does for us.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dsjax.kernels.common import (check_offsets, dot_tile, flash_init, flash_scores, flash_step, main_row_pieces,
                                  pad_axis, piece_width, row_width, triton_interpret, triton_params)
from dsjax.kernels.sparse_mqa.xla import combine

TARGET_PROGRAMS = 4 * 132   # enough programs to fill an H200's 132 SMs a few times over


def split_shape(n_keys: int, block_k: int, num_splits: int | None, other_programs: int):
    """(splits, keys per split): whole blocks per split, none empty; by default as many splits as it takes to
    reach TARGET_PROGRAMS programs, at least 4 blocks each."""
    blocks = max(1, -(-n_keys // block_k))
    if num_splits is None:
        num_splits = max(1, min(blocks // 4, -(-TARGET_PROGRAMS // other_programs)))
    splits = max(1, min(num_splits, blocks))
    return splits, -(-blocks // splits) * block_k


def partials(q, kv, idx, fmt, scale: float, *, block_k: int = 64, head_block: int = 64,
             num_splits: int | None = None, num_warps: int = 8, num_stages: int = 2, interpret=None):
    """Defaults: the fastest of the H200 sweep (docs/benchmarks.md, block_k 32/64 x head_block 32/64 x 4/8 warps)."""
    """q [B,Q,H,d], kv [B,N,R], idx int32 [B,Q,K] -> (m [B,Q,S,H], l [B,Q,S,H], acc [B,Q,S,H,d]) in fp32."""
    B, Q, H, d = q.shape
    assert row_width(kv, fmt) == d, (kv.shape, fmt, d)
    width = piece_width(kv, fmt, d)
    hp = dot_tile(H)
    hb = min(hp, head_block)
    groups = hp // hb
    S, per_split = split_shape(idx.shape[-1], block_k, num_splits, B * Q * groups)
    q2 = pad_axis(q.reshape(B * Q, H, d), 1, hp, 0)
    idx2 = pad_axis(idx.reshape(B * Q, -1).astype(jnp.int32), 1, S * per_split, -1)
    dt = q.dtype

    def body(q_ref, kv_ref, idx_ref, m_ref, l_ref, acc_ref):
        r, g, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        b, heads = r // Q, pl.ds(g * hb, hb)
        qs = [q_ref[r, heads, pl.ds(c, width)] for c in range(0, d, width)]

        def chunk(c, carry):
            ids = idx_ref[r, pl.ds(s * per_split + c * block_k, block_k)]
            ok = ids >= 0
            keys = [k for _, k in main_row_pieces(kv_ref, b, jnp.maximum(ids, 0), ok, fmt, width, dt)]
            return flash_step(carry, flash_scores(qs, keys, scale), ok[None, :], keys, dt)

        init = flash_init(hb, len(qs), width)
        m, l, accs = jax.lax.fori_loop(0, per_split // block_k, chunk, init)
        m_ref[r, s, heads] = m
        l_ref[r, s, heads] = l
        for c, a in zip(range(0, d, width), accs):
            acc_ref[r, s, heads, pl.ds(c, width)] = a

    f32 = jnp.float32
    check_offsets("sparse_mqa", q2, kv, idx2)
    m, l, acc = pl.pallas_call(
        body,
        out_shape=(jax.ShapeDtypeStruct((B * Q, S, hp), f32), jax.ShapeDtypeStruct((B * Q, S, hp), f32),
                   jax.ShapeDtypeStruct((B * Q, S, hp, d), f32)),
        grid=(B * Q, groups, S),
        compiler_params=triton_params(num_warps, num_stages),
        interpret=triton_interpret(interpret),
        name="sparse_mqa_partials",
    )(q2, kv, idx2)
    return (m[..., :H].reshape(B, Q, S, H), l[..., :H].reshape(B, Q, S, H),
            acc[:, :, :H].reshape(B, Q, S, H, d))


def sparse_mqa_decode(q, sink, window_kv, window_idx, comp_kv, comp_idx, *, scale: float, row_format,
                      num_splits: int | None = None, **options):
    part = functools.partial(partials, scale=scale, **options)
    parts = [part(q, window_kv, window_idx, row_format[0], num_splits=1)]
    if comp_kv is not None:
        parts.append(part(q, comp_kv, comp_idx, row_format[1], num_splits=num_splits))
    stacked = tuple(jnp.concatenate(x, axis=2) for x in zip(*parts))
    return combine(stacked, sink.astype(jnp.float32), q.dtype)
