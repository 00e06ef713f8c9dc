"""dsjax.layers.indexer.index_scores in key blocks (the bounded-memory form for long prompts, issue 9): the same
scores, bit for bit, as the one-shot form, and the block size that the byte limit implies."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsjax
from dsjax.layers import indexer


@pytest.fixture(scope="module")
def tiny_indexer():
    m = dsjax.load("tiny-v4", max_seq_len=16, max_batch=1)
    layer = next(l for l in m.params.layers if getattr(l.attn, "indexer", None) is not None)
    return m.cfg, layer.attn.indexer


@pytest.mark.parametrize("b,s,T,limit_keys", [(1, 5, 37, 8), (2, 3, 64, 16), (1, 4, 50, 1)])
def test_key_blocks_equal_the_one_shot_scores(test_seed, tiny_indexer, b, s, T, limit_keys):
    cfg, w = tiny_indexer
    ks = jax.random.split(jax.random.key(test_seed), 3)
    dt = jnp.bfloat16
    x = jax.random.normal(ks[0], (b, s, cfg.dim), jnp.float32).astype(dt)
    q = jax.random.normal(ks[1], (b, s, cfg.index_n_heads, cfg.index_head_dim), jnp.float32).astype(dt)
    keys = jax.random.normal(ks[2], (b, T, cfg.index_head_dim), jnp.float32).astype(dt)
    per_key = b * s * cfg.index_n_heads * 2
    one_shot = indexer.index_scores(x, q, keys, w, cfg)
    blocked = indexer.index_scores(x, q, keys, w, cfg, max_products_bytes=limit_keys * per_key)
    assert blocked.shape == one_shot.shape == (b, s, T) and blocked.dtype == one_shot.dtype
    np.testing.assert_array_equal(np.asarray(blocked.astype(jnp.float32)), np.asarray(one_shot.astype(jnp.float32)))
    assert np.asarray(one_shot.astype(jnp.float32)).max() > 0          # relu left something to compare


def test_blocks_start_where_the_products_pass_the_limit(tiny_indexer, monkeypatch):
    """The blocked form runs only above `PRODUCTS_BYTES` (V4.1-Flash at 1,024-token chunks: prompts past ~262k
    keys a layer), in blocks that keep the products under it."""
    cfg, w = tiny_indexer
    calls = []
    real = indexer.key_block_scores
    monkeypatch.setattr(indexer, "key_block_scores", lambda q, k, *a: calls.append(k.shape[1]) or real(q, k, *a))
    b, s, T = 1, 2, 40
    per_key = b * s * cfg.index_n_heads * 2
    x = jnp.ones((b, s, cfg.dim), jnp.bfloat16)
    q = jnp.ones((b, s, cfg.index_n_heads, cfg.index_head_dim), jnp.bfloat16)
    keys = jnp.ones((b, T, cfg.index_head_dim), jnp.bfloat16)
    indexer.index_scores(x, q, keys, w, cfg, max_products_bytes=T * per_key)
    indexer.index_scores(x, q, keys, w, cfg, max_products_bytes=12 * per_key)
    assert calls == [T, 12]                                  # one shot; then 4 blocks of 12 (traced once by map)
    assert 1024 * 32 * 2 * 262_144 <= indexer.PRODUCTS_BYTES < 1024 * 32 * 2 * 262_145
