"""Mosaic GPU (`plgpu.kernel`) flash-decoding over gathered keys: one block per (query row, key split).

A block holds one query's H heads [H, d] (all heads share the key, so every row it reads serves H dot products),
walks its split of the key list `block_k` rows at a time — one TMA copy per selected row, each on its own barrier,
straight from the stored layout (compact FP8 rows are dequantised in registers) — and keeps an online softmax
(max, sum, acc). The per-split partials are merged by `xla.combine`, which adds the sink; splitting the keys
lets long HCA lists (262k entries) fill the GPU even at batch 1.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from dsjax.kernels.common import gpu_interpret, load_rows, pad_axis, round_bf, row_width
from dsjax.kernels.sparse_mqa.xla import combine


def _split_shape(n_keys: int, block_k: int, num_splits: int | None):
    """(splits, keys per split): at most `num_splits` splits of whole blocks, none of them empty."""
    blocks = max(1, pl.cdiv(n_keys, block_k))
    splits = min(num_splits or max(1, blocks // 8), blocks)
    return splits, pl.cdiv(blocks, splits) * block_k


def partials(q, kv, idx, fmt, scale: float, *, block_k: int = 8, num_splits: int | None = None, interpret=None):
    """q [B,Q,H,d], kv [B,N,R], idx int32 [B,Q,K] -> (m [B,Q,S,H], l [B,Q,S,H], acc [B,Q,S,H,d]) in fp32."""
    B, Q, H, d = q.shape
    S, per_split = _split_shape(idx.shape[-1], block_k, num_splits)
    idx = pad_axis(idx.reshape(B * Q, -1), 1, S * per_split, -1)
    assert row_width(kv, fmt) == d, (kv.shape, fmt, d)
    n_chunks = per_split // block_k
    dt = q.dtype

    def body(q_ref, kv_ref, idx_ref, m_ref, l_ref, acc_ref, q_s, idx_s, rows_s, m_s, l_s, acc_s, bars):
        r, s = jax.lax.axis_index("row"), jax.lax.axis_index("split")
        b = r // Q
        plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(r, 1)], q_s, bars.at[0])
        plgpu.copy_gmem_to_smem(idx_ref.at[pl.ds(r, 1), pl.ds(s * per_split, per_split)], idx_s, bars.at[1])
        plgpu.barrier_wait(bars.at[0])
        plgpu.barrier_wait(bars.at[1])
        qf = q_s[0].astype(jnp.float32)                                          # [H, d]

        def chunk(c, carry):
            m, l, acc = carry
            plgpu.commit_smem()   # fence: the last chunk's register reads of rows_s precede the copies over it
            for j in range(block_k):   # one row per copy: the selected entries are scattered over the cache
                row = jnp.maximum(idx_s[0, c * block_k + j], 0)
                plgpu.copy_gmem_to_smem(kv_ref.at[b, pl.ds(row, 1)], rows_s.at[pl.ds(j, 1)], bars.at[2 + j])
            for j in range(block_k):
                plgpu.barrier_wait(bars.at[2 + j])
            keys = round_bf(load_rows(rows_s[...], fmt), dt)                      # [bk, d]
            valid = idx_s[0, pl.ds(c * block_k, block_k)] >= 0                    # [bk]
            logits = jax.lax.dot_general(qf, keys, (((1,), (1,)), ((), ())),
                                         precision=jax.lax.Precision.HIGHEST) * scale   # [H, bk]
            logits = jnp.where(valid[None, :], logits, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            alpha = jnp.exp(m - m_safe)
            p = jnp.where(valid[None, :], jnp.exp(logits - m_safe[:, None]), 0.0)
            pv = jax.lax.dot_general(round_bf(p, dt), keys, (((1,), (0,)), ((), ())),
                                     precision=jax.lax.Precision.HIGHEST)         # [H, d]
            return m_new, alpha * l + jnp.sum(p, axis=-1), alpha[:, None] * acc + pv

        init = (jnp.full((H,), -jnp.inf, jnp.float32), jnp.zeros((H,), jnp.float32), jnp.zeros((H, d), jnp.float32))
        m, l, acc = jax.lax.fori_loop(0, n_chunks, chunk, init)
        m_s[...], l_s[...], acc_s[...] = m[None], l[None], acc[None]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(m_s, m_ref.at[r, pl.ds(s, 1)])
        plgpu.copy_smem_to_gmem(l_s, l_ref.at[r, pl.ds(s, 1)])
        plgpu.copy_smem_to_gmem(acc_s, acc_ref.at[r, pl.ds(s, 1)])
        plgpu.wait_smem_to_gmem(0)

    f32 = jnp.float32
    kernel = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((B * Q, S, H), f32), jax.ShapeDtypeStruct((B * Q, S, H), f32),
                  jax.ShapeDtypeStruct((B * Q, S, H, d), f32)),
        grid=(B * Q, S), grid_names=("row", "split"),
        scratch_types=[plgpu.SMEM((1, H, d), dt), plgpu.SMEM((1, per_split), jnp.int32),
                       plgpu.SMEM((block_k, kv.shape[-1]), kv.dtype), plgpu.SMEM((1, H), f32),
                       plgpu.SMEM((1, H), f32), plgpu.SMEM((1, H, d), f32), plgpu.Barrier(num_barriers=2 + block_k)],
        interpret=gpu_interpret(interpret),
    )
    m, l, acc = kernel(q.reshape(B * Q, H, d), kv, idx)
    return m.reshape(B, Q, S, H), l.reshape(B, Q, S, H), acc.reshape(B, Q, S, H, d)


def sparse_mqa_decode(q, sink, window_kv, window_idx, comp_kv, comp_idx, *, scale: float, row_format,
                      block_k: int = 8, num_splits: int | None = None, interpret=None):
    part = functools.partial(partials, fmt=row_format, scale=scale, block_k=block_k, interpret=interpret)
    parts = [part(q, window_kv, window_idx, num_splits=1)]
    if comp_kv is not None:
        parts.append(part(q, comp_kv, comp_idx, num_splits=num_splits))
    stacked = tuple(jnp.concatenate(x, axis=2) for x in zip(*parts))
    return combine(stacked, sink.astype(jnp.float32), q.dtype)
