"""dsjax.kernels.moe_gemm.tile_operands: the expert kernels' A tiles (rows gathered by offset and stride, columns in
the MMA's order, FP8 codes) — the Triton kernel in interpret mode against the XLA form bit for bit, and the XLA form
against `quant.fp8_e4m3_sim` and `mosaic_fp4.mma_columns` (code we did not change for it)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsjax import quant
from dsjax.kernels.moe_gemm.mosaic_fp4 import mma_columns
from dsjax.kernels.moe_gemm.tile_operands import source_column, tile_operands, tile_operands_xla


@pytest.mark.parametrize("fp8", [True, False], ids=["e4m3", "bf16"])
def test_source_column_is_mma_columns(fp8):
    j = jnp.arange(32, dtype=jnp.int32)
    np.testing.assert_array_equal(source_column(j, fp8), mma_columns(j, fp8))


def _sources(seed, layout, T, N, K):
    """(src flat, row_offset [T, N], col_stride, the rows [T, N, K] they address, valid [T, N]): x-style (token rows
    of [n, K], tokens repeated across slots, stride 1) or h-style ([T, K, N] as the up kernel stores it, stride N).
    Values span 2^-12..2^4 in magnitude, so scale blocks differ in exponent."""
    ks = jax.random.split(jax.random.key(seed), 4)
    valid = jax.random.uniform(ks[0], (T, N)) < 0.7
    mag = jnp.exp2(jax.random.uniform(ks[1], (T * N, K), minval=-12, maxval=4))
    vals = (jax.random.normal(ks[2], (T * N, K)) * mag).astype(jnp.bfloat16)
    if layout == "x":
        n = 5
        src2 = vals[:n]
        token = jax.random.randint(ks[3], (T, N), 0, n)
        off, rows = token * K, src2[token]
        src, stride = src2.reshape(-1), 1
    else:
        h = vals.reshape(T, N, K).transpose(0, 2, 1)                                  # [T, K, N]
        off = jnp.arange(T)[:, None] * K * N + jnp.arange(N)[None, :]
        src, stride, rows = h.reshape(-1), N, vals.reshape(T, N, K)
    return src, jnp.where(valid, off, -1).astype(jnp.int32), stride, rows, valid


@pytest.mark.parametrize("layout", ["x", "h"])
@pytest.mark.parametrize("codes", [True, False], ids=["codes", "values"])
@pytest.mark.parametrize("N,block", [(8, 128), (24, 128), (16, 256), (80, 128)])  # 80: three programs a tile
def test_kernel_equals_xla_form_and_the_quantizer(test_seed, layout, codes, N, block):
    T, K = 3, 512
    src, off, stride, rows, valid = _sources(test_seed, layout, T, N, K)
    got_t, got_s = tile_operands(src, off, stride, K, codes=codes, block=block, interpret=True)
    want_t, want_s = tile_operands_xla(src, off, stride, K, codes=codes, block=block)
    assert got_t.shape == (T, K // 32, N, 32) and got_t.dtype == (jnp.float8_e4m3fn if codes else jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(got_t.astype(jnp.float32)), np.asarray(want_t.astype(jnp.float32)))
    if N == 8 and codes and layout == "x":   # the offsets flat with an entry past T x N (the route kernel's spare): unread
        flat = jnp.concatenate([off.reshape(-1), jnp.array([0], jnp.int32)])
        flat_t, flat_s = tile_operands(src, flat, stride, K, codes=codes, block=block, shape=(T, N), interpret=True)
        np.testing.assert_array_equal(np.asarray(flat_t.astype(jnp.float32)), np.asarray(got_t.astype(jnp.float32)))
        np.testing.assert_array_equal(np.asarray(flat_s), np.asarray(got_s))
    # the XLA form, undone: tiles -> [T, N, K] in column order; values x scales == the FP8 simulation of each row
    back = mma_columns_inverse(want_t.transpose(0, 2, 1, 3).reshape(T, N, K), codes).astype(jnp.float32)
    live = valid[..., None]
    if codes:
        assert got_s.shape == (T, K // 128, N)
        np.testing.assert_array_equal(np.asarray(got_s), np.asarray(want_s))
        assert not np.asarray(jnp.where(valid, 0.0, want_s.transpose(0, 2, 1).max(-1))).any()   # empty slots: 0
        value = back * jnp.repeat(want_s.transpose(0, 2, 1), 128, axis=-1)
        want = jnp.where(live, quant.fp8_e4m3_sim(rows, block).astype(jnp.float32), 0.0)
    else:
        assert got_s is None and want_s is None
        value, want = back, jnp.where(live, rows.astype(jnp.float32), 0.0)
    np.testing.assert_array_equal(np.asarray(value), np.asarray(want))


def mma_columns_inverse(a, fp8):
    """The columns back in their order: `mma_columns` is a permutation within 32-column blocks."""
    perm = np.asarray(mma_columns(jnp.arange(32), fp8))
    inv = np.argsort(perm)
    s = a.shape
    return a.reshape(s[:-1] + (s[-1] // 32, 32))[..., inv].reshape(s)


def test_refuses_partial_scale_blocks_and_short_offsets():
    src = jnp.zeros((4 * 320,), jnp.bfloat16)
    off = jnp.zeros((1, 8), jnp.int32)
    with pytest.raises(ValueError, match="whole scale blocks"):
        tile_operands(src, off, 1, 320, codes=True, interpret=True)
    with pytest.raises(ValueError, match="flat"):
        tile_operands_xla(src.reshape(4, 320), off, 1, 256, codes=True)
    with pytest.raises(ValueError, match="at least T x N"):
        tile_operands(src, off.reshape(-1), 1, 256, codes=True, shape=(2, 8), interpret=True)
    with pytest.raises(ValueError, match="at least T x N"):
        tile_operands_xla(src, off.reshape(-1), 1, 256, codes=True)
