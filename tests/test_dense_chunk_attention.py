"""The dense chunk-attention path (long chunks: shared key rows + mask) against the per-query gather path.

Both attend to the same keys with the same probabilities; in fp32 they may differ only in the order of the sums,
so logits agree to ~1e-6 of their scale. Chunks of 64 (the dense path's minimum) from an empty state and then
with a filled ring (start > 0), in a model with window, CSA (indexer top-k) and HCA layers.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsjax
from dsjax.layers import attention
from dsjax.model import forward_chunk
from dsjax.params import init_params
from dsjax.state import init_state

VOCAB = 1024
CHUNK = 64


def _chunks(cfg, params, ids):
    step = jax.jit(lambda p, i, s, n: forward_chunk(p, cfg, i, s, n))
    state, out = init_state(cfg, ids.shape[0], ids.shape[1]), []
    for pos in range(0, ids.shape[1], CHUNK):
        logits, state = step(params, jnp.asarray(ids[:, pos:pos + CHUNK]), state,
                             jnp.full((ids.shape[0],), CHUNK, jnp.int32))
        out.append(np.asarray(logits))
    return np.concatenate(out, axis=1)


def test_dense_path_matches_the_gather_path(test_seed, monkeypatch):
    cfg = dsjax.preset("tiny-v4", vocab_size=VOCAB, window_size=16, compress_ratios=(0, 4, 16, 4, 0),
                       n_layers=4, index_topk=8).with_numerics("transformers").replace(batch_invariant=False)
    params = init_params(cfg, test_seed)
    ids = np.random.default_rng(test_seed).integers(0, VOCAB, (2, 3 * CHUNK)).astype(np.int32)
    taken = []
    real = attention.dense_pays
    monkeypatch.setattr(attention, "dense_pays", lambda *a: taken.append(real(*a)) or taken[-1])
    dense = _chunks(cfg, params, ids)
    assert taken and all(taken), "every chunk of this config should take the dense path"
    monkeypatch.setattr(attention, "dense_pays", lambda *a: False)
    gathered = _chunks(cfg, params, ids)
    scale = np.abs(gathered).max()
    err = np.abs(dense - gathered).max()
    print(f"seed {test_seed}: max|dense - gather| {err:.3g} of logit scale {scale:.3g}")
    assert err <= 2e-5 * scale
    assert np.array_equal(dense.argmax(-1), gathered.argmax(-1))


@pytest.mark.parametrize("T,n,ratio,expect", [(1, 0, 0, False), (63, 16, 4, False), (64, 16, 4, True),
                                              (512, 128, 4, True), (64, 65536, 4, False)])
def test_dense_only_where_it_pays(T, n, ratio, expect):
    cfg = dsjax.preset("tiny-v4", window_size=128, index_topk=128)
    assert attention.dense_pays(cfg, T, n, ratio) is expect
    assert not attention.dense_pays(cfg.replace(batch_invariant=True), T, n, ratio)
