"""dsjax.kernels.indexer_topk: reference == the model's index_scores + select_topk (ties included); xla and the
Mosaic GPU scoring kernel (interpret mode on CPU, NaN-poisoned buffers) pick the same entries."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from interpret_races import INTERPRET
from lower_h200 import lower_for_h200

from dsjax import kv_rows, quant
from dsjax.kernels.common import IndexRowFormat, dequant_index_rows
from dsjax.kernels.indexer_topk import indexer_topk
from dsjax.kernels.indexer_topk.xla import topk_lower_index
from dsjax.layers.indexer import index_scores, select_topk
from dsjax.layers.linear import matmul
from dsjax.numerics import round_to

FMT = IndexRowFormat(dim=64, block=32)           # scaled down from 128 dims (68-byte rows) to 64 (34 bytes)
CFG = types.SimpleNamespace(index_head_dim=FMT.dim, index_n_heads=8, index_quant_block=FMT.block)


def _case(seed, compact, B=2, Q=3, N=200, D=32):
    ks = jax.random.split(jax.random.key(seed), 4)
    nh, dh = CFG.index_n_heads, CFG.index_head_dim
    x = jax.random.normal(ks[0], (B, Q, D), jnp.float32).astype(jnp.bfloat16)
    w = types.SimpleNamespace(weights_proj=jax.random.normal(ks[1], (nh, D), jnp.float32).astype(jnp.bfloat16))
    q = quant.fp4_e2m1_sim(jax.random.normal(ks[2], (B, Q, nh, dh), jnp.float32), FMT.block).astype(jnp.bfloat16)
    keys = quant.fp4_e2m1_sim(jax.random.normal(ks[3], (B, N, dh), jnp.float32), FMT.block).astype(jnp.bfloat16)
    keys = keys.at[:, 1::4].set(keys[:, 0::4][:, : keys[:, 1::4].shape[1]])   # duplicated rows: exact score ties
    n_visible = jnp.array([[0, 37, 150], [199, 200, 5]][:B], jnp.int32)[:, :Q]  # incl. a query seeing nothing
    weights = round_to(matmul(x, w.weights_proj, jnp.bfloat16).astype(jnp.float32)
                       * (dh ** -0.5 * nh ** -0.5), jnp.bfloat16)
    stored = kv_rows.pack_index(keys, CFG) if compact else keys
    return x, w, q, keys, stored, weights, n_visible


@pytest.mark.parametrize("compact", [False, True], ids=["bf16", "fp4rows"])
def test_reference_is_model_indexer(test_seed, compact):
    x, w, q, keys, stored, weights, n_visible = _case(test_seed, compact)
    k = 16
    got = indexer_topk(q, weights, stored, n_visible, k, row_format=FMT, implementation="reference")
    scores = index_scores(x, q, keys, w, CFG)
    visible = jnp.arange(keys.shape[1]) < n_visible[..., None]
    want = select_topk(scores, visible, k)
    for g, e in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(e))
    assert not np.any(np.asarray(got[1][0, 0])), "a query that sees no entry picks nothing valid"


def test_dequant_index_rows_is_exact(test_seed):
    keys = _case(test_seed, True)[3]
    rows = kv_rows.pack_index(keys, CFG)
    assert rows.shape[-1] == FMT.row_bytes and IndexRowFormat().row_bytes == 68
    np.testing.assert_array_equal(np.asarray(dequant_index_rows(rows, FMT).astype(jnp.bfloat16), np.float32),
                                  np.asarray(kv_rows.unpack_index(rows, CFG), np.float32))


@pytest.mark.parametrize("implementation", ["xla", "pallas", "mosaic"])
@pytest.mark.parametrize("compact", [False, True], ids=["bf16", "fp4rows"])
def test_matches_reference(test_seed, implementation, compact):
    _, _, q, _, stored, weights, n_visible = _case(test_seed + 1, compact)
    k = 24
    # Same roundings in the same order: the picks must be identical, ties and invalid slots included.
    opts = dict(tile=64)
    if implementation == "pallas":
        opts.update(block_n=64, interpret=True)
    elif implementation == "mosaic":
        implementation, opts = "pallas", dict(opts, backend="mosaic", block_n=64, interpret=INTERPRET)
    got = indexer_topk(q, weights, stored, n_visible, k, row_format=FMT, implementation=implementation, **opts)
    want = indexer_topk(q, weights, stored, n_visible, k, row_format=FMT, implementation="reference")
    for g, e in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(e))


@pytest.mark.parametrize("rows", [2, 4])
@pytest.mark.parametrize("compact", [False, True], ids=["bf16", "fp4rows"])
def test_mosaic_rows_per_program(test_seed, rows, compact):
    """Several query rows a program (the prefill form): the same scores as one row a program, bit for bit,
    including a program whose rows see different ranges (tiles past its furthest row are -inf) and the padding
    of Q (3 or 5 rows) to a multiple of the rows a program."""
    from dsjax.kernels.indexer_topk import pallas_gpu
    _, _, q, _, stored, weights, n_visible = _case(test_seed + 2, compact)
    q5, w5 = jnp.concatenate([q, q[:, :2]], axis=1), jnp.concatenate([weights, weights[:, :2]], axis=1)
    nv5 = jnp.concatenate([n_visible, jnp.array([[64, 0], [1, 130]], jnp.int32)], axis=1)
    for qq, ww, nv in ((q, weights, n_visible), (q5, w5, nv5)):
        run = lambda r: np.asarray(pallas_gpu.index_scores(qq, ww, stored, nv, FMT, block_n=64, rows_per_program=r,
                                                           interpret=INTERPRET))
        one, many = run(1), run(rows)
        assert many.shape == one.shape == (qq.shape[0], qq.shape[1], stored.shape[1])
        reach = np.asarray(nv).reshape(qq.shape[0], -1)
        for b in range(qq.shape[0]):
            for i in range(qq.shape[1]):
                group = reach[b, i - i % rows: i - i % rows + rows].max()    # the program's furthest row
                live = -(-int(reach[b, i]) // 64) * 64                       # tiles a row alone computes
                np.testing.assert_array_equal(many[b, i, :live], one[b, i, :live])
                assert np.all(many[b, i, -(-group // 64) * 64:] == -np.inf)


def test_two_stage_topk_at_1m_context(test_seed):
    """262,144 entries (1M tokens at ratio 4), top-512, scores drawn from 64 values so ties are everywhere."""
    rng = np.random.default_rng(test_seed)
    N, k = 262144, 512
    scores = jnp.asarray(rng.integers(0, 64, (2, N)).astype(np.float32))
    n_visible = jnp.array([N, 100_000], jnp.int32)
    got = topk_lower_index(scores, n_visible, k, tile=4096)
    top, idx = jax.lax.top_k(jnp.where(jnp.arange(N) < n_visible[:, None], scores, -jnp.inf), k)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(idx))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(jnp.isfinite(top)))


@pytest.mark.parametrize("compact", [False, True], ids=["bf16", "fp4rows"])
def test_triton_scores_exact_at_64_heads(test_seed, compact):
    """V4's 64 index heads x 128 dims: the Triton kernel's scores equal the reference's bit for bit (the head sum
    of bf16-rounded terms: roundings XLA's excess precision would drop in interpret mode are integer ops)."""
    from dsjax.kernels.indexer_topk import pallas_triton, reference
    fmt, nh, B, Q, N = IndexRowFormat(), 64, 1, 2, 300
    ks = jax.random.split(jax.random.key(test_seed), 3)
    q = quant.fp4_e2m1_sim(jax.random.normal(ks[0], (B, Q, nh, fmt.dim), jnp.float32), fmt.block).astype(jnp.bfloat16)
    w = (jax.random.normal(ks[1], (B, Q, nh), jnp.float32) * 0.1).astype(jnp.bfloat16)
    kv = jax.random.normal(ks[2], (B, N, fmt.dim), jnp.float32).astype(jnp.bfloat16)
    cfg = types.SimpleNamespace(index_head_dim=fmt.dim, index_quant_block=fmt.block)
    keys = kv_rows.pack_index(kv, cfg) if compact else quant.fp4_e2m1_sim(kv, fmt.block).astype(jnp.bfloat16)
    nv = jnp.array([[N, 130]], jnp.int32)
    got = np.asarray(pallas_triton.index_scores(q, w, keys, nv, fmt, interpret=True))
    want = np.asarray(reference.index_scores(q, w, keys, fmt), np.float32)
    np.testing.assert_array_equal(got[0, 0], want[0, 0])
    np.testing.assert_array_equal(got[0, 1, :128], want[0, 1, :128])      # tiles past n_visible: -inf, skipped
    assert np.all(got[0, 1, 256:] == -np.inf)


@pytest.mark.parametrize("backend", ["triton", "mosaic"])
@pytest.mark.parametrize("compact", [False, True], ids=["bf16", "fp4rows"])
def test_scoring_lowers_for_h200(compact, backend):
    """V4 shapes (64 index heads x 128 dims, 68-byte FP4 rows or bf16 keys, 6 queries) lower for CUDA: the Triton
    kernel to its TTIR module, the Mosaic GPU one through wgmma, SMEM transforms and layout inference."""
    from dsjax.kernels.indexer_topk import pallas_gpu, pallas_triton
    module, marker = {"triton": (pallas_triton, "xla.gpu.triton"), "mosaic": (pallas_gpu, "mosaic_gpu")}[backend]
    fmt = IndexRowFormat()
    B, Q, nh, dh, N = 2, 6, 64, 128, 4096
    S = jax.ShapeDtypeStruct
    keys = S((B, N, fmt.row_bytes), jnp.uint8) if compact else S((B, N, dh), jnp.bfloat16)
    text = lower_for_h200(lambda q, w, k, nv: module.index_scores(q, w, k, nv, fmt, interpret=False),
                          S((B, Q, nh, dh), jnp.bfloat16), S((B, Q, nh), jnp.bfloat16), keys, S((B, Q), jnp.int32))
    assert marker in text


def test_unknown_backend_is_a_clear_error():
    _, _, q, _, stored, weights, n_visible = _case(0, False)
    with pytest.raises(ValueError, match="backend must be one of .*'cuda'"):
        indexer_topk(q, weights, stored, n_visible, 8, row_format=FMT, implementation="pallas", backend="cuda")


@pytest.mark.parametrize("nh,rows", [(32, 4), (64, 2), (32, 8)])
def test_chunk_scoring_lowers_for_h200(nh, rows):
    """A prefill chunk's shapes (1,024 queries, 128k bf16 keys) with several rows a program lower through Mosaic
    GPU for CUDA: the [rows, nh, dh] q buffer, one wgmma a row, the [rows, block_n] score tile."""
    from dsjax.kernels.indexer_topk import pallas_gpu
    fmt, (B, Q, dh, N) = IndexRowFormat(), (1, 1024, 128, 131072)
    S = jax.ShapeDtypeStruct
    text = lower_for_h200(lambda q, w, k, nv: pallas_gpu.index_scores(q, w, k, nv, fmt, rows_per_program=rows,
                                                                       interpret=False),
                          S((B, Q, nh, dh), jnp.bfloat16), S((B, Q, nh), jnp.bfloat16), S((B, N, dh), jnp.bfloat16),
                          S((B, Q), jnp.int32))
    assert "mosaic_gpu" in text
