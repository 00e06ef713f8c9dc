"""dsjax.kernels.sparse_mqa: reference == the model's sink_attention; xla and the Triton-lowered Pallas kernel
(the HLO interpreter on CPU: outputs start as NaN, so anything unwritten shows) == reference, on fresh random
inputs; the kernel lowers for CUDA."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from lower_h200 import lower_for_h200

from dsjax import kv_rows, quant
from dsjax.kernels.common import Fp4RowFormat, MainRowFormat, dequant_main_rows, load_rows
from dsjax.kernels.sparse_mqa import hca_indices, sparse_mqa_decode, window_indices, window_rows
from dsjax.kernels.sparse_mqa.reference import gather_keys  # noqa: E402
from dsjax.layers.attention import sink_attention, window_keys  # noqa: E402

# A scaled-down V4 main row: 64 FP8 dims in one 64-block + 64 bf16 rope dims (d = 128, 200-byte rows).
FMT = MainRowFormat(nope=64, rope=64, block=64)
CFG = types.SimpleNamespace(nope_head_dim=FMT.nope, kv_quant_block=FMT.block, rope_head_dim=FMT.rope)


def _values(key, shape):
    """Main-KV values as the cache holds them: FP8-rounded non-rope dims, bf16 rope dims."""
    kv = jax.random.normal(key, shape, jnp.float32) * 2.0
    return jnp.concatenate([quant.fp8_e4m3_sim(kv[..., :FMT.nope], FMT.block), kv[..., FMT.nope:]], -1).astype(jnp.bfloat16)


def _case(seed, H, compact, B=2, Q=3, W=8, Nc=40, Kc=37):
    return _case_arrays(jax.random.key(seed), H, compact, B, Q, W, Nc, Kc)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5, 6, 7))
def _case_arrays(key, H, compact, B, Q, W, Nc, Kc):
    """_case's inputs as one compiled program (op by op, the random draws and FP8 packing cost seconds on CPU)."""
    ks = jax.random.split(key, 8)
    q = jax.random.normal(ks[0], (B, Q, H, FMT.dim), jnp.float32).astype(jnp.bfloat16)
    sink = jax.random.normal(ks[1], (H,), jnp.float32)
    ring, chunk, entries = _values(ks[2], (B, W, FMT.dim)), _values(ks[3], (B, Q, FMT.dim)), _values(ks[4], (B, Nc, FMT.dim))
    if compact:
        ring, chunk, entries = (kv_rows.pack_main(x, CFG) for x in (ring, chunk, entries))
    start = jnp.array([2, 11][:B], jnp.int32)                  # row 0 starts early: part of its window is invalid
    comp_idx = jax.random.randint(ks[5], (B, Q, Kc), -1, Nc)    # CSA-like picks with invalid (-1) holes
    comp_idx = comp_idx.at[0, 0].set(-1)
    win_idx = window_indices(start, Q, W).at[0, 0].set(-1)     # query (0, 0) has no valid key at all
    return q, sink, ring, chunk, entries, start, win_idx, comp_idx


@pytest.mark.parametrize("compact", [False, True], ids=["bf16", "fp8rows"])
def test_reference_is_sink_attention(test_seed, compact):
    q, sink, ring, chunk, entries, start, win_idx, comp_idx = _case(test_seed, 4, compact)
    win = window_rows(ring, chunk)
    out = sparse_mqa_decode(q, sink, win, win_idx, entries, comp_idx, scale=FMT.dim ** -0.5, row_format=FMT,
                            implementation="reference")
    wk, wv = gather_keys(win, win_idx, FMT, q.dtype)
    ck, cv = gather_keys(entries, comp_idx, FMT, q.dtype)
    want = sink_attention(q, jnp.concatenate([wk, ck], 2), jnp.concatenate([wv, cv], 2), sink, FMT.dim ** -0.5)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
    assert not np.any(np.asarray(out[0, 0], np.float32)), "a query with no valid key must return 0"


def test_window_indices_follow_window_keys(test_seed):
    q, sink, ring, chunk, entries, start, win_idx, _ = _case(test_seed, 1, False)
    keys, valid = window_keys(ring, chunk, start, ring.shape[1])
    idx = window_indices(start, chunk.shape[1], ring.shape[1])
    np.testing.assert_array_equal(np.asarray(idx >= 0), np.asarray(valid))
    got, _ = gather_keys(window_rows(ring, chunk), idx, FMT, ring.dtype)
    np.testing.assert_array_equal(np.asarray(jnp.where(valid[..., None], got, 0), np.float32),
                                  np.asarray(jnp.where(valid[..., None], keys, 0), np.float32))


def test_dequant_main_rows_is_exact(test_seed):
    kv = _values(jax.random.key(test_seed), (5, 7, FMT.dim))
    rows = kv_rows.pack_main(kv, CFG)
    assert rows.shape[-1] == FMT.row_bytes == kv_rows.main_row_bytes(CFG)
    np.testing.assert_array_equal(np.asarray(dequant_main_rows(rows, FMT).astype(jnp.bfloat16), np.float32),
                                  np.asarray(kv_rows.unpack_main(rows, CFG), np.float32))
    assert MainRowFormat().row_bytes == 584


def _decode_compiled(args, **kw):
    """sparse_mqa_decode as one program, as the model calls it (op by op, the reference costs seconds on CPU)."""
    return jax.jit(lambda a: sparse_mqa_decode(*a, **kw))(args)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("H", [8, 1], ids=["64/8-scaled", "64/64-scaled"])
@pytest.mark.parametrize("compact", [False, True], ids=["bf16", "fp8rows"])
def test_matches_reference(test_seed, implementation, H, compact):
    q, sink, ring, chunk, entries, start, win_idx, comp_idx = _case(test_seed + H, H, compact)
    args = (q, sink, window_rows(ring, chunk), win_idx, entries, comp_idx)
    kw = dict(scale=FMT.dim ** -0.5, row_format=FMT)
    opts = dict(block_k=16, num_splits=3, interpret=True) if implementation == "pallas" else {}
    got = np.asarray(_decode_compiled(args, **kw, implementation=implementation, **opts), np.float32)
    want = np.asarray(_decode_compiled(args, **kw, implementation="reference"), np.float32)
    # The split partials round p to bf16 relative to their own max, not the global one (≤ 2^-9 relative per
    # probability, so ≤ 2^-9·max|v| on the output), and the final bf16 rounding can then land one ulp
    # (≤ 2^-7·|x|) apart: 2^-6 of the largest |output| covers both.
    tol = 2.0 ** -6 * float(np.max(np.abs(want)))
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)
    assert not np.any(got[0, 0]), "a query with no valid key must return 0"


def test_hca_indices_cover_completed_entries():
    idx = hca_indices(jnp.array([[3, 7, 8]]), 4, 4)
    np.testing.assert_array_equal(np.asarray(idx), [[[0, -1, -1, -1], [0, 1, -1, -1], [0, 1, -1, -1]]])


@pytest.mark.parametrize("compact", [False, True], ids=["bf16", "fp8rows"])
def test_pallas_lowers_for_h200(compact):
    """V4 shapes (64 heads x 512 dims, 584-byte FP8 rows or bf16 values, 6 verify queries) lower to Triton."""
    from dsjax.kernels.sparse_mqa import pallas_triton
    fmt = MainRowFormat()
    B, Q, H, N, K = 2, 6, 64, 4096, 640
    S = jax.ShapeDtypeStruct
    kv = S((B, N, fmt.row_bytes), jnp.uint8) if compact else S((B, N, fmt.dim), jnp.bfloat16)
    text = lower_for_h200(lambda q, kv, idx: pallas_triton.partials(q, kv, idx, fmt, 0.04, interpret=False),
                          S((B, Q, H, fmt.dim), jnp.bfloat16), kv, S((B, Q, K), jnp.int32))
    assert "xla.gpu.triton" in text


# V4.1's rows (spec §4.1): window KV as 528-byte FP8 rows (e4m3 over all d dims, ue8m0 per 32 — V4's layout with
# no rope dims), compressed main KV as 288-byte FP4 rows (e2m1 pairs, e4m3 scale per 16); scaled to d = 64.
V41 = types.SimpleNamespace(head_dim=64, family="v4.1")
V41_FORMATS = (MainRowFormat(nope=64, rope=0, block=32), Fp4RowFormat(dim=64))


def _case41(seed, H=8, B=2, Q=3, W=8, Nc=40, Kc=37):
    return _case41_arrays(jax.random.key(seed), H, B, Q, W, Nc, Kc)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5, 6))
def _case41_arrays(key, H, B, Q, W, Nc, Kc):
    from dsjax import v41_rows
    ks = jax.random.split(key, 8)
    q = jax.random.normal(ks[0], (B, Q, H, 64), jnp.float32).astype(jnp.bfloat16)
    sink = jax.random.normal(ks[1], (H,), jnp.float32)
    window = lambda k, n: v41_rows.pack_window(  # noqa: E731
        quant.fp8_e4m3_sim(jax.random.normal(k, (B, n, 64), jnp.float32) * 2, 32).astype(jnp.bfloat16), V41)
    ring, chunk = window(ks[2], W), window(ks[3], Q)
    entries = v41_rows.quantize_main(jax.random.normal(ks[4], (B, Nc, 64), jnp.float32) * 2, V41)
    start = jnp.array([2, 11][:B], jnp.int32)
    comp_idx = jax.random.randint(ks[5], (B, Q, Kc), -1, Nc)
    return q, sink, window_rows(ring, chunk), window_indices(start, Q, W), entries, comp_idx


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_v41_rows_match_reference(test_seed, implementation):
    """The kernel reads V4.1's compact rows directly (FP8 window rows, FP4 compressed rows); the reference
    decodes them with `v41_rows` (checked equal to the kernels' decoders) and runs sink_attention."""
    from dsjax import v41_rows
    args = _case41(test_seed + 41)
    np.testing.assert_array_equal(np.asarray(v41_rows.unpack_main(args[4], V41, jnp.float32)),
                                  np.asarray(load_rows(args[4], V41_FORMATS[1])))
    np.testing.assert_array_equal(np.asarray(v41_rows.unpack_window(args[2], V41, jnp.float32)),
                                  np.asarray(load_rows(args[2], V41_FORMATS[0])))
    kw = dict(scale=64 ** -0.5, row_format=V41_FORMATS)
    opts = dict(block_k=16, num_splits=3, interpret=True) if implementation == "pallas" else {}
    got = np.asarray(_decode_compiled(args, **kw, implementation=implementation, **opts), np.float32)
    want = np.asarray(_decode_compiled(args, **kw, implementation="reference"), np.float32)
    np.testing.assert_allclose(got, want, rtol=0, atol=2.0 ** -6 * float(np.max(np.abs(want))))


def test_v41_rows_lower_for_h200():
    """V4.1-Flash shapes: 528-byte window rows and 288-byte FP4 rows lower to Triton."""
    from dsjax.kernels.sparse_mqa import pallas_triton
    S = jax.ShapeDtypeStruct
    for fmt, width in ((MainRowFormat(nope=512, rope=0, block=32), 528), (Fp4RowFormat(), 288)):
        text = lower_for_h200(lambda q, kv, idx: pallas_triton.partials(q, kv, idx, fmt, 0.04, interpret=False),
                              S((1, 6, 64, 512), jnp.bfloat16), S((1, 4096, width), jnp.uint8), S((1, 6, 640), jnp.int32))
        assert "xla.gpu.triton" in text
