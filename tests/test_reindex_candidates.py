"""V4.1 Reindex layers scoring only their candidates (`reindex_scope="candidates"`, dsjax.layers.reindex) give the
same model as scoring every key and masking: the tiny V4.1 model's logits bit for bit, over a prompt long enough
that most visible entries are not candidates (tiny-v41 keeps 3 blocks of 4 entries; 80 tokens at ratio 1 see up
to 80), in one chunk and in two (the latter with the gathered keys made in blocks of queries). Exact by construction (module docstring): each head's dot of FP4-quantised
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


@functools.partial(jax.jit, static_argnames=("cfg", "chunks"))
def _logits(params, ids, *, cfg, chunks):
    B, T = ids.shape
    state, outs = init_state41(cfg, B, T), []
    for part in jnp.split(ids, chunks, axis=1):
        y, state = forward_hidden41(params, cfg, part, state)
        outs.append(head_logits41(y, params, cfg))
    return jnp.concatenate(outs, axis=1)


@pytest.mark.parametrize("chunks", [1, 2])
def test_candidates_only_gives_the_same_logits(test_seed, chunks, monkeypatch):
    cfg = preset("tiny-v41").with_numerics("reference-bf16")
    mine = cfg.replace(reindex_scope="candidates")
    assert reindex.applies(mine) and not reindex.applies(cfg)
    params = init_params(cfg, test_seed % 1000)
    ids = jnp.asarray(np.random.default_rng(test_seed).integers(3, cfg.vocab_size, (2, 80)), jnp.int32)
    if chunks == 2:            # the queries' gathered keys in blocks of 2 queries (lax.map), as past GATHER_BYTES
        monkeypatch.setattr(reindex, "GATHER_BYTES", 4096)
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
