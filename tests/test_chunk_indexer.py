"""dsjax.layers.chunk_indexer: a prefill chunk's index scores through the Mosaic GPU scoring kernel (several
query rows a program; Mosaic GPU interpret mode on CPU) against the model's XLA `index_scores`, for V4 (tiny-v4)
and V4.1 (tiny-v41) index-key caches as each model stores them.

The bound: queries and keys are FP4-quantised as the model makes them, so each head's dot is exact in fp32 in any
order and its bf16 rounding, the ReLU and the weighting are the same on both sides; only the head sum adds its
bf16 terms in fp32 in another order, which can move the final rounding by one bf16 ulp. So every visible score
is within one ulp of XLA's, and nearly all are equal (observed on CPU: all; H200: max |diff| 3e-6 of the largest
score at 32 heads)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsjax import kernel_choice, kv_rows, quant, v41_rows
from dsjax.config import preset
from dsjax.layers.chunk_indexer import KERNEL_CHUNK, chunk_index_scores
from dsjax.params import init_params

CASES = {"tiny-v4": (kv_rows.store_index, kv_rows.load_index, 4),
         "tiny-v41": (v41_rows.store_index, v41_rows.load_index, 1)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_scores_equal_xla(test_seed, name):
    store, load, ratio = CASES[name]
    cfg = preset(name).with_numerics("reference-bf16")
    params = init_params(cfg, test_seed % 1000)
    w = next(l.attn.indexer for l in params.layers if getattr(l.attn, "indexer", None) is not None)
    B, T, N = 2, KERNEL_CHUNK, 96
    ks = jax.random.split(jax.random.key(test_seed), 3)
    x = jax.random.normal(ks[0], (B, T, cfg.dim), jnp.float32).astype(jnp.bfloat16)
    nh, dh, blk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_quant_block
    iq = quant.fp4_e2m1_sim(jax.random.normal(ks[1], (B, T, nh, dh), jnp.float32), blk).astype(jnp.bfloat16)
    keys = quant.fp4_e2m1_sim(jax.random.normal(ks[2], (B, N, dh), jnp.float32), blk).astype(jnp.bfloat16)
    stored = store(keys, cfg)
    start = jnp.array([0, 5 * ratio * T // 4], jnp.int32)       # row 1 starts late: its queries see up to N
    n_visible = jnp.minimum((start[:, None] + jnp.arange(T) + 1) // ratio, N)
    got, want = (np.asarray(chunk_index_scores(x, iq, w, cfg.replace(kernels=k), stored, load, n_visible))
                 for k in ("pallas", "xla"))
    assert got.dtype == want.dtype == np.float32 and got.shape == want.shape == (B, T, N)
    visible = np.arange(N) < np.asarray(n_visible)[..., None]
    assert visible.sum() > B * T                                # most queries see several entries
    got, want = got[visible], want[visible]
    ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(want), 2.0 ** -126))) - 7)   # bf16: 8 significant bits
    assert np.all(np.abs(got - want) <= ulp), np.max(np.abs(got - want) / ulp)
    assert np.mean(got == want) >= 0.99, np.mean(got == want)
    picked = kernel_choice.choices()["indexer_topk"]
    assert any(f"kernels=pallas rows={B * T} chunk={T} " in c and c.endswith("-> pallas") for c in picked), picked


def test_short_chunks_keep_xla(test_seed):
    """Below KERNEL_CHUNK tokens (decode, verify) this path stays on XLA even under kernels="pallas"."""
    cfg = preset("tiny-v41").with_numerics("reference-bf16").replace(kernels="pallas")
    w = next(l.attn.indexer for l in init_params(cfg, 0).layers if getattr(l.attn, "indexer", None) is not None)
    before = dict(kernel_choice.choices())
    x = jnp.ones((1, 6, cfg.dim), jnp.bfloat16)
    iq = jnp.ones((1, 6, cfg.index_n_heads, cfg.index_head_dim), jnp.bfloat16)
    stored = v41_rows.store_index(jnp.ones((1, 64, cfg.index_head_dim), jnp.bfloat16), cfg)
    out = chunk_index_scores(x, iq, w, cfg, stored, v41_rows.load_index, jnp.full((1, 6), 64, jnp.int32))
    assert out.shape == (1, 6, 64) and out.dtype == jnp.float32
    assert kernel_choice.choices().get("indexer_topk", []) == before.get("indexer_topk", [])


def test_under_a_mesh_keeps_xla(monkeypatch):
    """Under a device mesh the scores stay on XLA (GSPMD does not split a pallas_call), even under "pallas"."""
    from dsjax.layers import chunk_indexer
    monkeypatch.setattr(chunk_indexer, "active_mesh", lambda: object())
    cfg = preset("tiny-v41").with_numerics("reference-bf16").replace(kernels="pallas")
    w = next(l.attn.indexer for l in init_params(cfg, 0).layers if getattr(l.attn, "indexer", None) is not None)
    T = KERNEL_CHUNK
    x = jnp.ones((1, T, cfg.dim), jnp.bfloat16)
    iq = jnp.ones((1, T, cfg.index_n_heads, cfg.index_head_dim), jnp.bfloat16)
    stored = v41_rows.store_index(jnp.ones((1, 64, cfg.index_head_dim), jnp.bfloat16), cfg)
    chunk_index_scores(x, iq, w, cfg, stored, v41_rows.load_index, jnp.full((1, T), 64, jnp.int32))
    assert f"kernels=pallas rows={T} chunk={T} dtype=bfloat16 fmt=None sharded -> xla" in \
        kernel_choice.choices()["indexer_topk"]
