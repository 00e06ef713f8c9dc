"""V4.1's candidate blocks (`csa2.candidate_blocks`, spec §3.8 step 5) against a NumPy reference written from the
spec: block score = max over its positions, the newest visible entry's block pinned, the best `topk_blocks` blocks
above -inf kept, ties toward the lower block."""

import numpy as np
import pytest

import jax.numpy as jnp

from dsjax.layers.csa2 import candidate_blocks, candidate_ids


def reference(scores, compress_len, topk_blocks, block_size):
    *lead, N = scores.shape
    nb = -(-N // block_size)
    out = np.zeros(scores.shape, bool)
    for q in np.ndindex(*lead):
        row = np.full(nb * block_size, -np.inf, np.float32)
        row[:N] = scores[q]
        block = row.reshape(nb, block_size).max(-1)
        block[(compress_len[q] - 1) // block_size] = np.inf
        order = np.argsort(-block, kind="stable")[:min(topk_blocks, nb)]
        for b in order:
            if block[b] > -np.inf:
                out[q][b * block_size:(b + 1) * block_size] = True
    return out


@pytest.mark.parametrize("N,topk_blocks,block_size", [(61, 3, 4), (64, 5, 8), (200, 40, 8), (37, 50, 4)])
def test_candidate_blocks_match_the_spec(N, topk_blocks, block_size, test_seed):
    rng = np.random.default_rng(test_seed)
    B, T = 2, 5
    compress_len = rng.integers(1, N + 1, (B, T)).astype(np.int32)
    scores = rng.standard_normal((B, T, N)).astype(np.float32).round(1)              # ties between blocks
    scores = np.where(np.arange(N) < compress_len[..., None], scores, -np.inf).astype(np.float32)
    got = np.asarray(candidate_blocks(jnp.asarray(scores), jnp.asarray(compress_len), topk_blocks, block_size))
    np.testing.assert_array_equal(got, reference(scores, compress_len, topk_blocks, block_size))
    ids, kept = candidate_ids(jnp.asarray(scores), jnp.asarray(compress_len), topk_blocks, block_size)
    from_ids = np.zeros(got.shape[:-1] + (-(-N // block_size),), bool)
    for q in np.ndindex(B, T):
        from_ids[q][np.asarray(ids[q])[np.asarray(kept[q])]] = True
    np.testing.assert_array_equal(np.repeat(from_ids, block_size, -1)[..., :N], got)
