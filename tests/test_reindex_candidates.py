"""V4.1 Reindex layers scoring only their candidates (`reindex_scope="candidates"`, dsjax.layers.reindex) give the
same model as scoring every key and masking: a 5-layer tiny V4.1 model's logits bit for bit, over a prompt long enough
that most visible entries are not candidates (tiny-v41 keeps 3 blocks of 4 entries; 80 tokens at ratio 1 see up
to 80), in two chunks, the gathered keys made in blocks of queries; and the blocks against one piece. Exact by construction (module docstring): each head's dot of FP4-quantised
q and keys is exact in fp32 whatever else is scored beside it, and the picks' order is kept."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.config import ConfigError, preset
from dsjax.layers import reindex
from dsjax.params import init_params
from dsjax.v41_model import forward_hidden41, head_logits41
from dsjax.v41_state import init_state41
from tiny_v41_cut import FIVE_LAYERS  # one Reindex layer (4) after the candidate source (3)


@functools.partial(jax.jit, static_argnames=("cfg", "chunks"))
def _logits(params, ids, *, cfg, chunks):
    B, T = ids.shape
    state, outs = init_state41(cfg, B, T), []
    for part in jnp.split(ids, chunks, axis=1):
        y, state = forward_hidden41(params, cfg, part, state)
        outs.append(head_logits41(y, params, cfg))
    return jnp.concatenate(outs, axis=1)


def test_candidates_only_gives_the_same_logits(test_seed, monkeypatch):
    chunks = 2
    cfg = preset("tiny-v41", **FIVE_LAYERS).with_numerics("reference-bf16")
    mine = cfg.replace(reindex_scope="candidates")
    assert reindex.applies(mine) and not reindex.applies(cfg)
    params = init_params(cfg, test_seed % 1000)
    ids = jnp.asarray(np.random.default_rng(test_seed).integers(3, cfg.vocab_size, (2, 80)), jnp.int32)
    monkeypatch.setattr(reindex, "GATHER_BYTES", 4096)   # gathered keys in blocks of 2 queries, as past the limit
    traced = []
    real = reindex.candidate_picks
    monkeypatch.setattr(reindex, "candidate_picks", lambda *a: traced.append(1) or real(*a))
    want = np.asarray(_logits(params, ids, cfg=cfg, chunks=chunks))
    assert not traced
    got = np.asarray(_logits(params, ids, cfg=mine, chunks=chunks))
    reindex_layers = sum(1 for l in range(cfg.candidate_source_layer + 1, cfg.n_layers)
                         if l in cfg.index_source_layers)
    assert len(traced) == chunks * reindex_layers > 0          # the Reindex layers took the candidates path
    np.testing.assert_array_equal(got, want)


def test_scope_is_checked_and_guarded():
    """A bad scope is a clear error; where the full path could pick visible non-candidates (too few candidate
    positions for the top-k) or numerics the proof does not cover, the full path stays."""
    with pytest.raises(ConfigError, match="reindex_scope"):
        preset("tiny-v41").replace(reindex_scope="some")
    cfg = preset("tiny-v41").with_numerics("reference-bf16").replace(reindex_scope="candidates")
    assert reindex.applies(cfg)
    assert not reindex.applies(cfg.replace(candidate_topk_blocks=2))          # (2 - 1) x 4 + 1 = 5 < 8 picks
    assert not reindex.applies(cfg.with_numerics("transformers"))             # unquantised indexer
    assert not reindex.applies(cfg.replace(batch_invariant=True))


def test_blocked_gathers_equal_one_piece(test_seed, monkeypatch):
    """`candidate_picks` with its gathered keys made in blocks of queries (past GATHER_BYTES: lax.map, a ragged
    last block) equals the one-piece form."""
    from dsjax import quant
    from dsjax.layers.csa2 import candidate_ids
    cfg = preset("tiny-v41").with_numerics("reference-bf16").replace(reindex_scope="candidates")
    w = next(l.attn.indexer for l in init_params(cfg, 0).layers if getattr(l.attn, "indexer", None) is not None)
    B, T, N = 2, 7, 40
    ks = jax.random.split(jax.random.key(test_seed), 4)
    x = jax.random.normal(ks[0], (B, T, cfg.dim), jnp.float32).astype(jnp.bfloat16)
    blk, nh, dh = cfg.index_quant_block, cfg.index_n_heads, cfg.index_head_dim
    iq = quant.fp4_e2m1_sim(jax.random.normal(ks[1], (B, T, nh, dh), jnp.float32), blk).astype(jnp.bfloat16)
    keys = quant.fp4_e2m1_sim(jax.random.normal(ks[2], (B, N, dh), jnp.float32), blk).astype(jnp.bfloat16)
    n_visible = jnp.array([[3, 9, 17, 25, 33, 39, 40], [1, 2, 5, 12, 40, 40, 40]], jnp.int32)
    scores = jnp.where(jnp.arange(N) < n_visible[..., None], jax.random.normal(ks[3], (B, T, N)), -jnp.inf)
    ids, kept = candidate_ids(scores, n_visible, cfg.candidate_topk_blocks, cfg.candidate_block_size)
    args = (x, iq, w, cfg, keys, ids, kept, n_visible)
    one = reindex.candidate_picks(*args)
    monkeypatch.setattr(reindex, "GATHER_BYTES", 4096)                 # 2 queries a block: 4 blocks, the last ragged
    blocked = reindex.candidate_picks(*args)
    for a, b in zip(one, blocked):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.asarray(one[1]).sum() > 0
