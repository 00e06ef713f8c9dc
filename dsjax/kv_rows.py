"""Compact KV cache rows, lossless for the reference presets (the values are already fake-quantised).

- main KV (V4): 448 e4m3 codes + 7 ue8m0 scale bytes (one per 64 values) + 64 bf16 rope dims = 583 → 584 bytes
  instead of 1024 in bf16 (the `fp8_ds_mla` layout engines use);
- index keys: e2m1 codes packed two per byte + one ue8m0 byte per 32 values: 128 dims → 68 bytes instead of 256.

The scale of each block is re-derived from the stored values: a fake-quantised block v = code·2^e has
max|v| ≤ 448·2^e (6·2^e for FP4), so 2^ceil(log2(max|v|/448)) ≤ 2^e, and dividing by the smaller power of two only
shifts exponents — every value stays exactly representable. Packing then unpacking returns the same bits.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from dsjax import quant
from dsjax.config import ModelConfig


def main_rows_compact(cfg: ModelConfig) -> bool:
    """V4 reference presets keep window and compressed main KV in 584-byte rows."""
    return cfg.family == "v4" and cfg.kv_quant_sim and cfg.compute_dtype == "bfloat16"


def index_rows_compact(cfg: ModelConfig) -> bool:
    return cfg.index_quant_sim and cfg.compute_dtype == "bfloat16"


def main_row_bytes(cfg: ModelConfig) -> int:
    nope, blk = cfg.nope_head_dim, cfg.kv_quant_block
    raw = nope + nope // blk + 2 * cfg.rope_head_dim
    return -(-raw // 8) * 8 if raw % 8 else raw  # 583 -> 584: rows stay 8-byte aligned


def index_row_bytes(cfg: ModelConfig) -> int:
    return cfg.index_head_dim // 2 + cfg.index_head_dim // cfg.index_quant_block


def pack_main(kv, cfg: ModelConfig):
    """[..., d] fake-quantised main KV (bf16) -> uint8 [..., main_row_bytes]."""
    nope, blk, rd = cfg.nope_head_dim, cfg.kv_quant_block, cfg.rope_head_dim
    x = kv[..., :nope].astype(jnp.float32).reshape(kv.shape[:-1] + (nope // blk, blk))
    amax = jnp.maximum(jnp.max(jnp.abs(x), axis=-1, keepdims=True), np.float32(1e-4))
    s = quant.ue8m0_ceil_scale(amax * np.float32(1.0 / 448.0))
    codes = (x / s).astype(jnp.float8_e4m3fn).view(jnp.uint8).reshape(kv.shape[:-1] + (nope,))
    scale_bytes = quant.f32_to_e8m0_exact(s[..., 0])
    rope = kv[..., nope:].astype(jnp.bfloat16).view(jnp.uint16)
    rope_bytes = jnp.stack([rope & 0xFF, rope >> 8], axis=-1).astype(jnp.uint8).reshape(kv.shape[:-1] + (2 * rd,))
    pad = main_row_bytes(cfg) - (nope + nope // blk + 2 * rd)
    parts = [codes, scale_bytes.astype(jnp.uint8), rope_bytes]
    if pad:
        parts.append(jnp.zeros(kv.shape[:-1] + (pad,), jnp.uint8))
    return jnp.concatenate(parts, axis=-1)


def unpack_main(rows, cfg: ModelConfig, dtype=jnp.bfloat16):
    """uint8 [..., main_row_bytes] -> [..., d] in `dtype` (exact)."""
    nope, blk, rd = cfg.nope_head_dim, cfg.kv_quant_block, cfg.rope_head_dim
    nb = nope // blk
    codes = rows[..., :nope].view(jnp.float8_e4m3fn).astype(jnp.float32)
    s = quant.e8m0_to_f32(rows[..., nope:nope + nb])
    vals = (codes.reshape(rows.shape[:-1] + (nb, blk)) * s[..., None]).reshape(rows.shape[:-1] + (nope,))
    rb = rows[..., nope + nb: nope + nb + 2 * rd].astype(jnp.uint16).reshape(rows.shape[:-1] + (rd, 2))
    rope = (rb[..., 0] | (rb[..., 1] << 8)).view(jnp.bfloat16)
    return jnp.concatenate([vals.astype(dtype), rope.astype(dtype)], axis=-1)


def pack_index(k, cfg: ModelConfig):
    """[..., index_head_dim] FP4-fake-quantised index keys -> uint8 [..., index_row_bytes]."""
    blk = cfg.index_quant_block
    x = k.astype(jnp.float32).reshape(k.shape[:-1] + (k.shape[-1] // blk, blk))
    amax = jnp.maximum(jnp.max(jnp.abs(x), axis=-1, keepdims=True), np.float32(6 * 2.0 ** -126))
    s = quant.ue8m0_ceil_scale(amax * np.float32(1.0 / 6.0))
    v = x / s
    codes = (quant._e2m1_index(jnp.abs(v), jnp) | (jnp.signbit(v).astype(jnp.int32) << 3)).astype(jnp.uint8)
    packed = quant.pack_fp4_codes(codes.reshape(k.shape))
    return jnp.concatenate([packed, quant.f32_to_e8m0_exact(s[..., 0]).astype(jnp.uint8)], axis=-1)


def unpack_index(rows, cfg: ModelConfig, dtype=jnp.bfloat16):
    dh, blk = cfg.index_head_dim, cfg.index_quant_block
    return quant.dequantize_fp4_packed(rows[..., : dh // 2], rows[..., dh // 2:], blk, dtype=dtype)


def store_main(kv, cfg: ModelConfig):
    """Main KV as the cache keeps it: compact rows for the V4 reference presets, else as is."""
    return pack_main(kv, cfg) if main_rows_compact(cfg) else kv


def load_main(stored, cfg: ModelConfig):
    return unpack_main(stored, cfg, jnp.dtype(cfg.compute_dtype)) if main_rows_compact(cfg) else stored


def store_index(k, cfg: ModelConfig):
    return pack_index(k, cfg) if index_rows_compact(cfg) else k


def load_index(stored, cfg: ModelConfig):
    return unpack_index(stored, cfg, jnp.dtype(cfg.compute_dtype)) if index_rows_compact(cfg) else stored
