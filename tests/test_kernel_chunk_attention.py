"""dsjax.kernels.chunk_attention: the reference equals the model's per-query key lists (window_keys +
compressed_visible / picks through sink_attention); xla and the Triton-lowered Pallas kernel (the HLO interpreter
on CPU: outputs start as NaN, so anything unwritten shows) equal the reference on fresh random inputs; the kernel
visits only the key blocks its rows can see; both Pallas kernels lower for CUDA at V4 shapes (the Mosaic GPU
kernel's interpret-mode tests: test_kernel_chunk_attention_mosaic.py)."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from lower_h200 import lower_for_h200

from dsjax import kv_rows, quant
from dsjax.kernels.chunk_attention import chunk_attention, compressed_segment, window_segment
from dsjax.kernels.chunk_attention.rows import block_ranges
from dsjax.kernels.common import MainRowFormat
from dsjax.layers.attention import compressed_visible, sink_attention, window_keys
from dsjax.kernels.common import load_rows

FMT = MainRowFormat(nope=64, rope=64, block=64)          # d = 128: 64 FP8 dims + 64 bf16 rope dims
CFG = types.SimpleNamespace(nope_head_dim=FMT.nope, kv_quant_block=FMT.block, rope_head_dim=FMT.rope)
W, RATIO = 8, 4


def _values(key, shape):
    kv = jax.random.normal(key, shape, jnp.float32) * 2.0
    return jnp.concatenate([quant.fp8_e4m3_sim(kv[..., :FMT.nope], FMT.block), kv[..., FMT.nope:]], -1).astype(jnp.bfloat16)


def _case(seed, H, compact, T=24, B=2, picks=False, starts=(3, 37)):
    """Row 0 starts at 3 (part of its window unwritten, early queries see no entry), row 1 at 37 (or `starts`:
    from 256 on, a kernel's first tile of 64 entries is visible to every query)."""
    return _case_arrays(jax.random.key(seed), H, compact, T, B, picks, tuple(starts))


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5, 6))
def _case_arrays(key, H, compact, T, B, picks, starts):
    """_case as one compiled program (op by op, its random draws and FP8 packing cost seconds a case on CPU)."""
    ks = jax.random.split(key, 6)
    start = jnp.array(starts[:B], jnp.int32)
    q_pos = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    N = (max(starts[:B]) + T) // RATIO
    q = jax.random.normal(ks[0], (B, T, H, FMT.dim), jnp.float32).astype(jnp.bfloat16)
    sink = jax.random.normal(ks[1], (H,), jnp.float32)
    ring, chunk, entries = _values(ks[2], (B, W, FMT.dim)), _values(ks[3], (B, T, FMT.dim)), _values(ks[4], (B, N, FMT.dim))
    # ring slots never written (position < 0) hold garbage the kernel must not read as keys
    if compact:
        ring, chunk, entries = (kv_rows.pack_main(x, CFG) for x in (ring, chunk, entries))
    idx = None
    if picks:
        vis = compressed_visible(q_pos, N, RATIO)
        idx = jax.random.randint(ks[5], (B, T, 5), 0, N)
        idx = jnp.where(jnp.take_along_axis(vis, idx, axis=2), idx, -1)
    return q, q_pos, sink, ring, chunk, entries, start, idx


def _lists(q, q_pos, sink, ring, chunk, entries, start, idx, hca: bool):
    """The model's per-query key lists: window_keys, then every visible entry (HCA) or the picks (CSA)."""
    keys, valid = window_keys(load_rows(ring, FMT), load_rows(chunk, FMT), start, W)
    ents = load_rows(entries, FMT)
    if hca:
        c_keys = jnp.broadcast_to(ents[:, None], (q.shape[0], q.shape[1]) + ents.shape[1:])
        c_ok = compressed_visible(q_pos, ents.shape[1], RATIO)
    else:
        c_keys = jax.vmap(lambda e, i: e[jnp.maximum(i, 0)])(ents, idx)
        c_ok = idx >= 0
    keys = jnp.concatenate([keys, c_keys], 2).astype(q.dtype)
    return sink_attention(q, keys, jnp.concatenate([valid, c_ok], 2), sink, FMT.dim ** -0.5)


def _run(case, hca, implementation, **opts):
    q, q_pos, sink, ring, chunk, entries, start, idx = case
    segs = [window_segment(ring, chunk, start, W)] + ([compressed_segment(entries, RATIO)] if hca else [])
    picks = None if hca else (entries, idx)
    return chunk_attention(q, q_pos, sink, segs, picks, scale=FMT.dim ** -0.5, row_format=FMT,
                           implementation=implementation, **opts)


def _run_compiled(case, hca, implementation, **opts):
    """_run as one program, as the model calls it (op by op, the reference alone costs seconds on CPU)."""
    return jax.jit(lambda c: _run(c, hca, implementation, **opts))(case)


@pytest.mark.parametrize("hca", [True, False], ids=["hca", "csa"])
def test_reference_is_the_models_key_lists(test_seed, hca):
    case = _case(test_seed, 4, False, picks=not hca)
    got = np.asarray(_run_compiled(case, hca, "reference"), np.float32)
    want = np.asarray(jax.jit(lambda c: _lists(*c, hca=hca))(case), np.float32)
    # the same keys in a different order: the fp32 sums differ in order only; the outputs are bf16 (2^-8 relative)
    np.testing.assert_allclose(got, want, rtol=0, atol=2.0 ** -7 * float(np.max(np.abs(want))))


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("hca", [True, False], ids=["hca", "csa"])
@pytest.mark.parametrize("compact", [False, True], ids=["bf16", "fp8rows"])
def test_matches_reference(test_seed, implementation, hca, compact):
    case = _case(test_seed + 7, 4, compact, picks=not hca)
    opts = dict(block_q=16, block_k=16, interpret=True) if implementation == "pallas" else {}
    got = np.asarray(_run_compiled(case, hca, implementation, **opts), np.float32)
    want = np.asarray(_run_compiled(case, hca, "reference"), np.float32)
    # flash partials round p to bf16 against the running max, not the final one (≤ 2^-9 relative each), and the
    # bf16 output can then land one ulp (2^-7) apart: 2^-6 of the largest |output| covers both (as sparse_mqa)
    np.testing.assert_allclose(got, want, rtol=0, atol=2.0 ** -6 * float(np.max(np.abs(want))))
    assert np.all(np.isfinite(got))


def test_block_ranges_cover_exactly_the_visible_blocks(test_seed):
    """Every visible key lies inside its program's range; a 128-wide window at position 10,000 costs 2-3
    blocks, not 157."""
    rng = np.random.default_rng(test_seed)
    start = jnp.array([int(rng.integers(0, 20000))], jnp.int32)
    T, Wd, H, bq, bk = 256, 128, 2, 16, 64
    seg = window_segment(jnp.zeros((1, Wd, 4)), jnp.zeros((1, T, 4)), start, Wd)
    q_pos = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    row_pos = jnp.repeat(q_pos, H, axis=1)
    kb0, kb1 = (np.asarray(x) for x in block_ranges(row_pos, seg.lo, seg.hi, bq, bk))
    vis = np.asarray((seg.lo[:, None, :] <= row_pos[..., None]) & (row_pos[..., None] < seg.hi[:, None, :]))
    for p in range(kb0.shape[1]):
        seen = np.flatnonzero(vis[0, p * bq:(p + 1) * bq].any(axis=0))
        if seen.size:
            assert kb0[0, p] * bk <= seen.min() and seen.max() < kb1[0, p] * bk
            assert kb1[0, p] - kb0[0, p] <= -(-(seen.max() - seen.min() + 1) // bk) + 1
    print(f"start {int(start[0])}: blocks per program {sorted(set((kb1 - kb0)[0].tolist()))}")


@pytest.mark.parametrize("backend", ["triton", "mosaic", "mosaic-x1", "mosaic-x2", "mosaic-overlap"])
@pytest.mark.parametrize("picks", [False, True], ids=["window+hca", "window+csa-picks"])
def test_pallas_lowers_for_h200(picks, backend):
    """V4 shapes (64 heads x 512, 584-byte FP8 rows, a 1,024-token chunk at 64k context) lower to Triton, and
    through Mosaic GPU (wgmma operands, ~200 KB of shared memory, three warpgroups; by default no partial-score
    exchange; x1: one buffer; x2: two beside one key stage — with two stages they pass the 232,448 bytes there
    are; overlap: the next tile's Q·Kᵀ in flight through this one's softmax)."""
    opts = {"mosaic-x2": dict(backend="mosaic", exchange_buffers=2, stages=1),
            "mosaic-x1": dict(backend="mosaic", exchange_buffers=1),
            "mosaic-overlap": dict(backend="mosaic", exchange_buffers=1, overlap_qk=True)}.get(backend, dict(backend=backend))
    from dsjax.kernels.chunk_attention import Segment
    fmt = MainRowFormat()
    B, T, H, N = 1, 1024, 64, 512
    S = jax.ShapeDtypeStruct
    i32 = jnp.int32

    def f(q, q_pos, sink, win, wlo, whi, ent, elo, ehi, idx):
        segs = [Segment(win, wlo, whi)] + ([] if picks else [Segment(ent, elo, ehi)])
        return chunk_attention(q, q_pos, sink, segs, (ent, idx) if picks else None, scale=0.04, row_format=fmt,
                               implementation="pallas", interpret=False, **opts)

    rows = S((B, 128 + T, fmt.row_bytes), jnp.uint8)
    text = lower_for_h200(f, S((B, T, H, fmt.dim), jnp.bfloat16), S((B, T), i32), S((H,), jnp.float32),
                          rows, S((B, 128 + T), i32), S((B, 128 + T), i32), S((B, N, fmt.row_bytes), jnp.uint8),
                          S((B, N), i32), S((B, N), i32), S((B, T, 512), i32))
    assert {"triton": "xla.gpu.triton", "mosaic": "mosaic_gpu"}[opts["backend"]] in text


def test_unknown_backend_is_a_clear_error():
    case = _case(0, 4, False)
    with pytest.raises(ValueError, match="backend must be one of .*'cuda'"):
        _run(case, True, "pallas", backend="cuda")


def test_model_backend_auto_is_the_triton_interpreter_off_gpu(monkeypatch):
    """kernels="pallas" prefill: Mosaic GPU on a GPU, the Triton kernel through the HLO interpreter on CPU (Mosaic
    GPU's interpreter needs a thread per warpgroup); an explicit choice wins."""
    from dsjax.layers import sparse_attention
    assert sparse_attention.chunk_attention_backend() == ("mosaic" if jax.default_backend() == "gpu" else "triton")
    monkeypatch.setattr(sparse_attention, "CHUNK_ATTENTION_BACKEND", "mosaic")
    assert sparse_attention.chunk_attention_backend() == "mosaic"
