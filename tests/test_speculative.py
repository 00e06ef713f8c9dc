"""Speculative decoding (MTP draft -> verify -> accept -> commit inside one while_loop): tests that cannot be fooled.

- spec greedy == plain greedy token for token in the fp32 transformers preset (batch > 1, verify blocks that
  straddle compressor groups of ratio 4 and 16 and a window of 8): rollback leaves no trace;
- an oracle drafter (the target's own greedy continuation) is accepted in full: k+1 tokens every step;
- an oracle corrupted with probability 1-α gives mean acceptance length (1-α^{k+1})/(1-α) (listed seeds,
  ≥ 240 steps, a 6-sigma bound);
- rejection sampling is lossless: the first committed token's distribution equals the target's (chi-square,
  listed seeds, N = 20000, p > 1e-6) for a draft distribution unlike the target;
- one dispatch runs N steps with no host callback in the loop.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import dsjax
from acceptance_bounds import assert_closed_form_acceptance
from dsjax.params import init_params
from dsjax.sampling import SamplingParams, filtered_logprobs, make_sampling
from dsjax.speculative import OracleDrafts, accept, spec_steps

# One worker runs the module, and every prompt set's longest prompt lies in (16, 32]: the tests share the compiled
# prefill chunks and the loops that their settings have in common (plain, k=1, k=3, k=3 with oracle drafts).
pytestmark = pytest.mark.xdist_group("speculative")
VOCAB = 1024
# one layer of each kind (window + hash routing, CSA, HCA) and the MTP layer: depth adds compile time, not cases
SMALL = dict(vocab_size=VOCAB, window_size=8, n_layers=3, compress_ratios=(0, 4, 16, 0), n_hash_layers=1,
             index_topk=4)


@functools.lru_cache(maxsize=None)
def model():
    cfg = dsjax.preset("tiny-v4", **SMALL).with_numerics("transformers")
    return dsjax.Model(cfg, init_params(cfg, 5), source="test", max_seq_len=96, max_batch=4)


def _prompts(seed, lengths):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, VOCAB, n).tolist() for n in lengths]


def _oracle(plain, alpha):
    """The plain greedy continuations as drafts (kept with probability alpha), padded to one width (80 ≥ 70 + k + 1)
    so that both oracle tests run the same compiled loop."""
    return OracleDrafts(jnp.asarray([p.tokens + [0] * (80 - len(p.tokens)) for p in plain], jnp.int32),
                        jnp.float32(alpha))


@pytest.mark.parametrize("k", [1, 3])
def test_spec_greedy_equals_plain_greedy(k, test_seed):
    m = model()
    prompts = _prompts(test_seed, (6, 19, 31, 2))
    plain = m.generate(prompts, 30, stop_token_ids=[])
    spd = 7 if k == 1 else 32  # k=1: many dispatch boundaries; k=3 shares its compiled loop with the tests below
    spec = m.generate(prompts, 30, stop_token_ids=[], speculative="mtp", num_draft_tokens=k, steps_per_dispatch=spd)
    for p, s in zip(plain, spec):
        assert s.tokens == p.tokens
        assert s.stats["drafted"] == k * s.stats["row_steps"]


def test_oracle_drafts_are_accepted_in_full(test_seed):
    m, k = model(), 3
    prompts = _prompts(test_seed + 1, (9, 26, 4, 13))
    # 69 tokens: the same buffer size (and so the same compiled loops) as the corrupted-oracle test's 70
    plain = m.generate(prompts, 69, stop_token_ids=[])
    oracle = _oracle(plain, 1.0)
    spec = m.generate(prompts, 69, stop_token_ids=[], speculative="mtp", num_draft_tokens=k, oracle_drafts=oracle)
    for p, s in zip(plain, spec):
        assert s.tokens == p.tokens
        # 1 token from the prefill, then 17 steps of k+1 = 4: 69 tokens; every draft accepted
        assert s.stats["row_steps"] == 17 and s.stats["accepted"] == 17 * k
        assert s.stats["acceptance_length"] == k + 1 and s.stats["acceptance_per_position"] == [1.0] * k


def test_corrupted_oracle_matches_the_closed_form(test_seed):
    """Fresh prompts and sampling seed each run (printed); the 6-sigma bound makes a false failure ~1e-9."""
    seed = test_seed % (2 ** 31)
    m, k, alpha = model(), 3, 0.6
    prompts = _prompts(seed, (5, 8, 11, 21))
    plain = m.generate(prompts, 70, stop_token_ids=[])
    oracle = _oracle(plain, alpha)
    spec = m.generate(prompts, 70, stop_token_ids=[], speculative="mtp", num_draft_tokens=k, oracle_drafts=oracle,
                      seed=seed)
    for p, s in zip(plain, spec):
        assert s.tokens == p.tokens  # corrupted drafts never change greedy output
    assert_closed_form_acceptance(spec, alpha, k, seed, min_steps=4 * 69 / (k + 1))


@functools.partial(jax.jit, static_argnames=("N",))
def _first_committed(target, draft_logits, sampling_key, draft_key, *, N):
    """For i < N: the first token `accept` commits for target / drafts drawn from q, with the i-th folded keys.
    The seeds' keys and logits are arguments, so the listed seeds share one compiled program."""
    k = draft_logits.shape[1]
    sp1 = make_sampling(1, temperature=1.0, top_k=8)

    def one(i):
        sp = SamplingParams(sp1.temperature, sp1.top_k, sp1.top_p, sp1.min_p,
                            jax.random.key_data(jax.random.fold_in(sampling_key, i))[None])
        q = jax.vmap(lambda lg: filtered_logprobs(lg, sp), in_axes=1, out_axes=1)(draft_logits)
        keys = jax.random.split(jax.random.fold_in(draft_key, i), k)
        d = jnp.stack([jax.random.categorical(keys[j], q[0, j]) for j in range(k)])[None].astype(jnp.int32)
        _, out = accept(target, d, q, sp, jnp.zeros((1,), jnp.int32), None, 0)
        return out[0, 0]

    return jax.vmap(one)(jnp.arange(N))


@jax.jit
def _first_logprobs(target, sp):
    """The target's first-position log-probabilities after the sampling filters: one compiled program (eager: 40)."""
    return filtered_logprobs(target[:, 0], sp)[0]


@pytest.mark.parametrize("seed", [7, 8, 9])
def test_rejection_sampling_is_lossless(seed):
    """The first committed token is distributed as the target's p, whatever the drafter's q."""
    V, k, N = 10, 2, 20000
    rng = np.random.default_rng(seed)
    target = jnp.asarray(rng.normal(0, 1.5, (1, k + 1, V)), jnp.float32)
    draft_logits = jnp.asarray(rng.normal(0, 1.5, (1, k, V)), jnp.float32)
    sp1 = make_sampling(1, temperature=1.0, top_k=8)
    first = np.asarray(_first_committed(target, draft_logits, jax.random.PRNGKey(seed), jax.random.PRNGKey(seed + 1000),
                                        N=N))
    p = np.exp(np.asarray(_first_logprobs(target, sp1)).astype(np.float64))
    support = p > 0
    assert set(np.unique(first).tolist()) <= set(np.nonzero(support)[0].tolist())
    counts = np.bincount(first, minlength=V)[support]
    _, pval = stats.chisquare(counts, counts.sum() * p[support] / p[support].sum())
    assert pval > 1e-6, f"chi-square p = {pval:.2e}"


def test_one_dispatch_runs_many_steps_without_host_callbacks(test_seed):
    m = model()
    prompts = _prompts(test_seed + 3, (7, 12, 3, 18))
    gens = m.generate(prompts, 25, stop_token_ids=[], speculative="mtp", num_draft_tokens=3, steps_per_dispatch=32)
    assert all(g.stats["steps"] == 24 for g in gens)  # one dispatch (≤ 32 steps): 24 steps after the prefill's token
    jaxpr = str(jax.make_jaxpr(lambda *a: spec_steps.__wrapped__(*a, cfg=m.cfg, k=3, max_steps=4, max_seq=96))(
        *_spec_args(m, prompts)))
    assert "while" in jaxpr
    assert "callback" not in jaxpr and "io_callback" not in jaxpr and "debug" not in jaxpr


def _spec_args(m, prompts):
    """A small SpecCarry and friends, built through the public path's own code (stream) for the jaxpr check."""
    from dsjax import generate as G

    opts = G.GenerateOptions(max_new_tokens=25, stop_token_ids=(), speculative="mtp", num_draft_tokens=3,
                             steps_per_dispatch=32)  # the test's own settings: its compiled loop is reused
    gen = G.stream(m.params, m.cfg, prompts, opts, max_seq=m.max_seq_len, max_batch=m.max_batch)
    _, _, st = next(gen)
    _, _, st = next(gen)
    carry = st["carry"]
    sp = make_sampling(4)
    return m.params, carry, sp, jnp.zeros((0,), jnp.int32), jnp.full((4,), 25, jnp.int32), None, None


def test_reference_preset_matches_plain_greedy_until_a_near_tie(test_seed):
    """bf16 + FP8/FP4 rounding: the verify block (k+1 rows) and single-token decode round differently, so greedy
    outputs may part only where the plain run's top-2 logit margin is below δ = 0.5 (≈ 2x the reference's own
    decode-vs-recompute noise on logits, 0.09-0.34)."""
    cfg = dsjax.preset("tiny-v4", **SMALL).with_numerics("reference-bf16")
    m = dsjax.Model(cfg, init_params(cfg, 5), source="test", max_seq_len=96, max_batch=4)
    prompts = _prompts(test_seed + 4, (6, 19, 31, 2))
    plain = m.generate(prompts, 30, stop_token_ids=[], logprobs=2)
    spec = m.generate(prompts, 30, stop_token_ids=[], speculative="mtp", num_draft_tokens=3)
    for p, s in zip(plain, spec):
        margins = [lp["top"][0][1] - lp["top"][1][1] for lp in p.logprobs]
        first_tie = next((i for i, mg in enumerate(margins) if mg < 0.5), len(margins))
        assert s.tokens[:first_tie + 1] == p.tokens[:first_tie + 1], f"parted before the first near-tie at {first_tie}"


def test_forced_acceptance_is_simulated(test_seed):
    m = model()
    prompts = _prompts(test_seed + 5, (7, 12, 3, 18))
    gens = m.generate(prompts, 17, stop_token_ids=[], speculative="mtp", num_draft_tokens=3, forced_acceptance=(3, 1))
    for g in gens:
        assert g.stats["simulated"] is True
        # after the prefill's token: steps commit 4, 2, 4, 2, 4 tokens (3 or 1 forced drafts + 1): 16 in 5 steps
        assert len(g.tokens) == 17 and g.stats["row_steps"] == 5 and g.stats["accepted"] == 3 + 1 + 3 + 1 + 3
        assert g.stats["acceptance_length"] == pytest.approx(16 / 5)


def test_rollback_leaves_no_trace_in_the_caches(test_seed):
    """After speculative generation the target's caches equal, bit for bit, those of a plain prefill of the
    prompt + committed tokens: rejected verify positions left nothing in rings, compressor groups or entries."""
    from dsjax import generate as G
    from dsjax.model import forward_chunk
    from dsjax.state import init_state

    m = model()
    prompts = _prompts(test_seed + 6, (7, 12, 3, 18))
    opts = G.GenerateOptions(max_new_tokens=26, stop_token_ids=(), speculative="mtp", num_draft_tokens=3)
    *_, last = G.stream(m.params, m.cfg, prompts, opts, max_seq=m.max_seq_len, max_batch=m.max_batch)
    carry = last[2]["carry"]
    toks = np.asarray(carry.tokens)
    fed = [p + toks[b, :25].tolist() for b, p in enumerate(prompts)]  # the newest token is not fed yet
    n = np.array([len(f) for f in fed])
    assert np.array_equal(np.asarray(carry.state.lengths), n)
    buf = np.zeros((4, max(n)), np.int32)
    for b, f in enumerate(fed):
        buf[b, :len(f)] = f
    _, plain = jax.jit(lambda p, i, s, v: forward_chunk(p, m.cfg, i, s, v))(
        m.params, jnp.asarray(buf), init_state(m.cfg, 4, m.max_seq_len), jnp.asarray(n, jnp.int32))
    for ours, ref in zip(jax.tree.leaves(carry.state.layers), jax.tree.leaves(plain.layers)):
        assert np.array_equal(np.asarray(ours), np.asarray(ref))
