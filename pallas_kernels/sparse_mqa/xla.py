"""The XLA path (baseline and fallback): gather + dequantise the selected rows, one softmax partial per key
source (window, compressed), then the flash-decoding combine that the Pallas path shares."""

import jax
import jax.numpy as jnp

from dsjax.kernels.common import load_rows, round_bf


def partials(q, kv, idx, fmt, scale: float):
    """Softmax partials of q [B,Q,H,d] over one key source: (max [B,Q,H], sum [B,Q,H], acc [B,Q,H,d]) in fp32."""
    rows = jax.vmap(lambda kb, ib: kb[jnp.maximum(ib, 0)])(kv, idx)
    return masked_partials(q, load_rows(rows, fmt).astype(q.dtype), idx >= 0, scale)


def masked_partials(q, keys, valid, scale: float):
    """Partials of q [B,Q,H,d] over keys [B,Q,K,d] per query, or [B,K,d] shared by all, valid [B,Q,K].

    p is taken relative to this source's max and rounded to the compute dtype before P·V (the reference's
    rounding, up to the shift of the max); -inf max and zero sum/acc when the source holds no valid key.
    """
    kspec = "bqkd" if keys.ndim == 4 else "bkd"
    ok = valid[:, :, None, :]
    logits = jnp.einsum(f"bqhd,{kspec}->bqhk", q, keys, preferred_element_type=jnp.float32) * scale
    logits = jnp.where(ok, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(ok, jnp.exp(logits - m_safe[..., None]), 0.0)
    acc = jnp.einsum(f"bqhk,{kspec}->bqhd", p.astype(q.dtype), keys, preferred_element_type=jnp.float32)
    return m, jnp.sum(p, axis=-1), acc


def combine(parts, sink, dtype):
    """Merge partials (m [...,S,H], l [...,S,H], acc [...,S,H,d]; S splits) with the sink in the denominator."""
    m, l, acc = parts
    top = jnp.max(m, axis=-2)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w = jnp.exp(m - top[..., None, :])                       # 0 for splits without a valid key
    denom = jnp.sum(w * l, axis=-2) + jnp.exp(sink - top)
    o = jnp.sum(w[..., None] * acc, axis=-3)
    return round_bf(o / denom[..., None], dtype).astype(dtype)


def sparse_mqa_decode(q, sink, window_kv, window_idx, comp_kv, comp_idx, *, scale: float, row_format):
    sources = [(window_kv, window_idx, row_format[0])] + ([(comp_kv, comp_idx, row_format[1])] if comp_kv is not None else [])
    parts = [partials(q, kv, idx, fmt, scale) for kv, idx, fmt in sources]
    stacked = tuple(jnp.stack(x, axis=-2 if i < 2 else -3) for i, x in enumerate(zip(*parts)))
    return combine(stacked, sink.astype(jnp.float32), q.dtype)
