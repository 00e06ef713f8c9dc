"""Compact V4.1 cache rows (the paper's layout, spec §4.1), lossless for the reference presets.

- window KV: 512 e4m3 codes + one ue8m0 byte per 32 values = 528 bytes (instead of 1024 in bf16);
- compressed main KV: e2m1 codes packed two per byte + one e4m3 scale byte per 16 values = 256 + 32 = 288 bytes;
- index keys: `kv_rows.pack_index` (packed e2m1 + ue8m0 per 32: 128 dims -> 68 bytes).

Window rows and index keys re-derive their power-of-two scales from the stored (already fake-quantised) values, as
in `kv_rows` (2^ceil(log2(max|v|/448)) never exceeds the original scale, so every value stays representable). Main
rows are written by the quantiser itself (`quantize_main`). Unpacking returns the fake-quantised values bit for bit.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from dsjax import kv_rows, quant
from dsjax.config import ModelConfig
from dsjax.numerics import div_rn

MAIN_BLOCK = 16   # FP4 main KV: one e4m3 scale per 16 values
WINDOW_BLOCK = 32  # FP8 window KV: one ue8m0 scale per 32 values


def compact(cfg: ModelConfig) -> bool:
    """The reference presets (fake-quantised bf16 values) keep V4.1 caches in compact rows."""
    return cfg.family == "v4.1" and cfg.kv_quant_sim and cfg.compute_dtype == "bfloat16"


def index_compact(cfg: ModelConfig) -> bool:
    return cfg.family == "v4.1" and cfg.index_quant_sim and cfg.compute_dtype == "bfloat16"


def window_row_bytes(cfg: ModelConfig) -> int:
    return cfg.head_dim + cfg.head_dim // WINDOW_BLOCK


def main_row_bytes(cfg: ModelConfig) -> int:
    return cfg.head_dim // 2 + cfg.head_dim // MAIN_BLOCK


def pack_window(kv, cfg: ModelConfig):
    """[..., d] FP8-rounded window KV (bf16) -> uint8 [..., d + d/32]."""
    d = cfg.head_dim
    x = kv.astype(jnp.float32).reshape(kv.shape[:-1] + (d // WINDOW_BLOCK, WINDOW_BLOCK))
    amax = jnp.maximum(jnp.max(jnp.abs(x), axis=-1, keepdims=True), np.float32(1e-4))
    s = quant.ue8m0_ceil_scale(amax * np.float32(1.0 / 448.0))
    codes = (x / s).astype(jnp.float8_e4m3fn).view(jnp.uint8).reshape(kv.shape[:-1] + (d,))
    return jnp.concatenate([codes, quant.f32_to_e8m0_exact(s[..., 0]).astype(jnp.uint8)], axis=-1)


def unpack_window(rows, cfg: ModelConfig, dtype=jnp.bfloat16):
    d = cfg.head_dim
    codes = rows[..., :d].view(jnp.float8_e4m3fn).astype(jnp.float32)
    s = quant.e8m0_to_f32(rows[..., d:])
    vals = codes.reshape(rows.shape[:-1] + (d // WINDOW_BLOCK, WINDOW_BLOCK)) * s[..., None]
    return vals.reshape(rows.shape[:-1] + (d,)).astype(dtype)


def quantize_main(kv, cfg: ModelConfig):
    """[..., d] rotated main KV (before rounding) -> uint8 [..., d/2 + d/16]: the e2m1 codes and e4m3 scales of
    `quant.fp4_e2m1_sim(kv, 16, scale_format="e4m3")`, computed by the same formulas, so unpacking gives its values.
    (Packed from the quantiser, not re-derived from values: a subnormal e4m3 scale can leave a block's largest
    code below 6, and then the scale cannot be read back from the values.)"""
    d = cfg.head_dim
    x = kv.astype(jnp.float32).reshape(kv.shape[:-1] + (d // MAIN_BLOCK, MAIN_BLOCK))
    amax = jnp.maximum(jnp.max(jnp.abs(x), axis=-1, keepdims=True), np.float32(6 * 2.0 ** -9))
    s = jnp.minimum(div_rn(amax, quant.FP4_MAX), np.float32(quant.FP8_MAX)).astype(jnp.float8_e4m3fn)
    v = jnp.clip(div_rn(x, quant.e4m3_values(s)), -quant.FP4_MAX, quant.FP4_MAX)  # not astype: XLA:GPU drops it
    codes = (quant._e2m1_index(jnp.abs(v), jnp) | (jnp.signbit(v).astype(jnp.int32) << 3)).astype(jnp.uint8)
    packed = quant.pack_fp4_codes(codes.reshape(kv.shape[:-1] + (d,)))
    return jnp.concatenate([packed, s[..., 0].view(jnp.uint8)], axis=-1)


def unpack_main(rows, cfg: ModelConfig, dtype=jnp.bfloat16):
    d = cfg.head_dim
    vals = quant._fp4_decode_arith(quant.unpack_fp4_codes(rows[..., : d // 2]))
    s = rows[..., d // 2:].view(jnp.float8_e4m3fn).astype(jnp.float32)
    vals = vals.reshape(rows.shape[:-1] + (d // MAIN_BLOCK, MAIN_BLOCK)) * s[..., None]
    return vals.reshape(rows.shape[:-1] + (d,)).astype(dtype)


def store_window(kv, cfg):
    return pack_window(kv, cfg) if compact(cfg) else kv


def load_window(rows, cfg):
    return unpack_window(rows, cfg, jnp.dtype(cfg.compute_dtype)) if compact(cfg) else rows


def load_main(rows, cfg):
    return unpack_main(rows, cfg, jnp.dtype(cfg.compute_dtype)) if compact(cfg) else rows


def store_index(k, cfg):
    return kv_rows.pack_index(k, cfg) if index_compact(cfg) else k


def load_index(rows, cfg):
    return kv_rows.unpack_index(rows, cfg, jnp.dtype(cfg.compute_dtype)) if index_compact(cfg) else rows


def row_shapes(cfg: ModelConfig) -> dict[str, tuple[int, object]]:
    """(width, dtype) of window, main and index rows as the state allocates them."""
    dt = jnp.dtype(cfg.compute_dtype)
    return {"window": (window_row_bytes(cfg), jnp.uint8) if compact(cfg) else (cfg.head_dim, dt),
            "main": (main_row_bytes(cfg), jnp.uint8) if compact(cfg) else (cfg.head_dim, dt),
            "index": (kv_rows.index_row_bytes(cfg), jnp.uint8) if index_compact(cfg) else (cfg.index_head_dim, dt)}
