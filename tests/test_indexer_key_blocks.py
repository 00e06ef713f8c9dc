"""dsjax.layers.indexer.index_scores in key blocks (the bounded-memory form for long prompts, issue 9): the same
scores as the one-shot form up to the fp32 summation order XLA picks per shape, and the block size that the byte
limit implies."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsjax
from dsjax.layers import indexer
from dsjax.layers.linear import einsum_acc32
from dsjax.numerics import round_to


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
    got, want = np.asarray(blocked.astype(jnp.float32)), np.asarray(one_shot.astype(jnp.float32))
    # Not bit for bit: XLA:CPU picks the dot's and the head sum's fp32 order per shape, a block of 16 keys is another
    # shape than 64 (seed 126762710: a few scores one or more bf16 steps apart). An order change moves a head's fp32
    # product by ulps, which can flip its bf16 rounding (one bf16 ulp: at most 2^-7 of |p_h|, so of |term_h| after
    # the weight), then the rounding of the weighted term (another 2^-7 of |term_h|) and the final rounding of the
    # sum (2^-7 of |score|). Bound per score: 2^-6 Σ_h |term_h| + 2^-7 |score|; a key scored against the wrong
    # query or dropped by the blocking is off by the whole score. Flips are rare: at least 95% must be equal.
    products = np.asarray(round_to(einsum_acc32("bshd,btd->bsht", q, keys), dt).astype(jnp.float32))
    weights = np.asarray(indexer.index_weights(x, w, cfg).astype(jnp.float32))
    terms = np.abs(np.maximum(products, 0) * weights[..., None]).sum(axis=2)
    np.testing.assert_array_less(np.abs(got - want), 2.0 ** -6 * terms + 2.0 ** -7 * np.abs(want) + 1e-30)
    assert np.mean(got == want) >= 0.95, f"only {np.mean(got == want):.1%} of the scores are equal"
    assert want.max() > 0          # relu left something to compare


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
