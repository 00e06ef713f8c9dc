"""V4.1 compact cache rows (v41_rows): lossless for the reference presets, the paper's sizes (spec §4.1)."""

import jax
import jax.numpy as jnp
import numpy as np

import dsjax
from dsjax import quant, v41_rows


def _bits(x):
    return np.asarray(x.astype(jnp.bfloat16)).view(np.uint16)


def test_v41_rows_round_trip_bit_for_bit(test_seed):
    """Fresh random latents over 12 decades (subnormal e4m3 scales included), zero and tiny blocks: main rows
    unpack to `fp4_e2m1_sim(., 16, e4m3)` exactly, window rows to `fp8_e4m3_sim(., 32)`, index rows to FP4/32."""
    cfg = dsjax.preset("v4.1-flash")
    assert v41_rows.compact(cfg) and v41_rows.index_compact(cfg)
    assert (v41_rows.main_row_bytes(cfg), v41_rows.window_row_bytes(cfg)) == (288, 528)
    rng = np.random.default_rng(test_seed)
    x = rng.normal(size=(2, 32, 512)) * np.exp(rng.uniform(-14, 14, size=(2, 32, 1)))
    x[0, 0, :16] = 0.0
    x[0, 1, :16] = 1e-30
    x = jnp.asarray(x.astype(np.float32)).astype(jnp.bfloat16)
    main = jax.jit(v41_rows.quantize_main, static_argnums=1)(x, cfg)
    assert main.shape == (2, 32, 288) and main.dtype == jnp.uint8
    unpack = jax.jit(v41_rows.unpack_main, static_argnums=1)
    assert np.array_equal(_bits(unpack(main, cfg)), _bits(quant.fp4_e2m1_sim(x, 16, scale_format="e4m3")))
    w = quant.fp8_e4m3_sim(x, 32)
    window = jax.jit(lambda w: v41_rows.load_window(v41_rows.store_window(w, cfg), cfg))
    assert np.array_equal(_bits(window(w)), _bits(w))
    k = quant.fp4_e2m1_sim(x[..., :128], 32)
    stored = jax.jit(v41_rows.store_index, static_argnums=1)(k, cfg)
    load = jax.jit(v41_rows.load_index, static_argnums=1)
    assert stored.shape[-1] == 68 and np.array_equal(_bits(load(stored, cfg)), _bits(k))
    fp32 = cfg.with_numerics("transformers")
    assert not v41_rows.compact(fp32) and v41_rows.load_main(x, fp32) is x
