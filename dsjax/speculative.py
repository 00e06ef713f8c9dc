"""Speculative decoding on the device: MTP draft -> verify (k+1 positions, one target forward) -> accept -> commit,
many steps per dispatch inside one `lax.while_loop`.

Per row, the carry holds the committed state (target caches and the MTP ring), the newest token (not yet fed),
and the target streams of the positions the MTP has not consumed yet (`pend_*`, at most k+1). A step:

1. MTP catch-up: the pending positions (true target streams, true next tokens) go through the MTP block, which
   commits its ring and drafts d1 from the last one; d2..dk chain on its own stream over a scratch ring.
2. Verify: the target runs [newest, d1..dk] at positions L..L+k in one chunk.
3. Accept: greedy (prefix match, then the target's own token) or lossless rejection sampling; stop ids and
   token budgets cut the committed run.
4. Commit: `commit_chunk` re-derives the target state for the committed prefix only, so rejected positions leave
   no trace in window rings, compressor groups, compressed KV or index keys.

Shapes never depend on how many tokens were accepted: counts are arrays, writes past them are dropped.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from dsjax.config import ModelConfig
from dsjax.decode import is_stop, run_until_done
from dsjax.model import commit_chunk, forward_hidden_chunk, head_logits
from dsjax.mtp import mtp_hidden, mtp_logits
from dsjax.sharding import gather_vocab
from dsjax.sampling import SamplingParams, filtered_logprobs, token_logprobs
from dsjax.weights import pytree

_DRAFT, _ACCEPT, _RESIDUAL = 1, 2, 3  # independent random streams per position


@pytree
class SpecCarry:
    state: object          # DecodeState with the MTP ring
    last: jax.Array        # int32 [B]
    pend_h: jax.Array      # [B, k+1, n, D]: target streams at positions L-pend_n .. L-1
    pend_tok: jax.Array    # int32 [B, k+1]: the token after each pending position
    pend_n: jax.Array      # int32 [B]
    tokens: jax.Array      # int32 [B, N]
    logprob: jax.Array     # f32 [B, N]
    count: jax.Array       # int32 [B]
    done: jax.Array        # bool [B]
    steps: jax.Array       # int32 []
    drafted: jax.Array     # int32 [B]
    accepted: jax.Array    # int32 [B]
    accepted_at: jax.Array  # int32 [B, k]: accepted drafts by draft position


@pytree(meta=("mode",))
class Forced:
    """Forced acceptance for benchmarks ("simulated"): per step, accept `pattern[step % len]` drafts
    (mode "pattern") regardless of the tokens. Results measure speed, not the model."""
    pattern: jax.Array     # int32 [P]
    mode: str = "pattern"


@pytree
class OracleDrafts:
    """Test drafter: drafts are `tokens[b, count + j]` (a known continuation), each replaced with probability
    1 - keep by a different token. Checks acceptance against its closed form without a trained MTP."""
    tokens: jax.Array      # int32 [B, T]
    keep: jax.Array        # f32 []


def _key(sp: SamplingParams, position, purpose: int):
    return jax.vmap(lambda k, p: jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(k), p), purpose))(
        sp.key, position)


def _draw(keys, logprobs):
    return jax.vmap(lambda k, lp: jax.random.categorical(k, lp).astype(jnp.int32))(keys, logprobs)


def oracle_draft(oracle: OracleDrafts, carry: SpecCarry, sp: SamplingParams, k: int, V: int):
    idx = jnp.minimum(carry.count[:, None] + jnp.arange(k)[None], oracle.tokens.shape[1] - 1)
    true = jnp.take_along_axis(oracle.tokens, idx, axis=1)
    keys = _key(sp, carry.state.lengths, 7)
    u = jax.vmap(lambda kk: jax.random.uniform(kk, (k,)))(keys)
    shift = jax.vmap(lambda kk: jax.random.randint(jax.random.fold_in(kk, 1), (k,), 1, V))(keys)
    drafts = jnp.where(u < oracle.keep, true, (true + shift) % V).astype(jnp.int32)
    return drafts, jax.nn.log_softmax(jnp.where(jax.nn.one_hot(drafts, V, dtype=bool), 0.0, -jnp.inf), -1)


def draft(params, cfg: ModelConfig, carry: SpecCarry, sp: SamplingParams, k: int):
    """Drafts d1..dk [B,k] with their filtered log-probabilities [B,k,V], and the committed MTP ring."""
    st = carry.state
    L = st.lengths
    z, ring = mtp_hidden(params, cfg, carry.pend_h, carry.pend_tok, st.mtp[0], L - carry.pend_n, carry.pend_n)
    rows = jnp.arange(L.shape[0])
    z = z[rows, carry.pend_n - 1][:, None]                                          # [B,1,n,D]
    greedy = sp.temperature <= 0
    drafts, qs = [], []
    scratch = ring
    for j in range(k):
        logits = gather_vocab(mtp_logits(params, cfg, z)[:, 0], cfg.sharding)
        q = filtered_logprobs(logits, sp)
        d = jnp.where(greedy, jnp.argmax(logits, -1).astype(jnp.int32), _draw(_key(sp, L + 1 + j, _DRAFT), q))
        drafts.append(d)
        qs.append(q)
        if j + 1 < k:  # chain: the MTP at position L+j takes its own stream and the draft just made
            z, scratch = mtp_hidden(params, cfg, z, d[:, None], scratch, L + j, jnp.ones_like(L))
    return jnp.stack(drafts, 1), jnp.stack(qs, 1), ring


def accept(logits, drafts, qs, sp: SamplingParams, L, forced: Forced | None, step, offered=None):
    """Greedy or lossless rejection sampling. Returns (accepted drafts a [B], committed tokens [B,k+1]).
    `offered` [B] (default k): only the first offered[b] drafts are verified; after them the target samples."""
    B, K1, V = logits.shape
    k = K1 - 1
    greedy = sp.temperature <= 0
    y = jnp.argmax(logits, -1).astype(jnp.int32)                                   # [B,k+1]
    g_ok = drafts == y[:, :k]
    ps = jax.vmap(lambda lg: filtered_logprobs(lg, sp), in_axes=1, out_axes=1)(logits)   # [B,k+1,V]
    p_d = jnp.take_along_axis(ps[:, :k], drafts[..., None], -1)[..., 0]
    q_d = jnp.take_along_axis(qs, drafts[..., None], -1)[..., 0]
    u = jnp.stack([jax.vmap(lambda kk: jax.random.uniform(kk))(_key(sp, L + 1 + j, _ACCEPT)) for j in range(k)], 1)
    s_ok = jnp.log(u) < p_d - q_d                                                   # u < p/q
    ok = jnp.where(greedy[:, None], g_ok, s_ok)
    if offered is not None:
        ok = ok & (jnp.arange(k)[None] < offered[:, None])
    else:
        offered = jnp.full((B,), k, jnp.int32)
    a = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)                 # leading accepts
    if forced is not None:
        a = jnp.minimum(forced.pattern[step % forced.pattern.shape[0]], k) * jnp.ones_like(a)
    rows = jnp.arange(B)
    p_a = ps[rows, a]                                                               # target at the first open slot
    q_a = jnp.where((a < offered)[:, None], qs[rows, jnp.minimum(a, k - 1)], -jnp.inf)
    resid = jnp.log(jnp.maximum(jnp.exp(p_a) - jnp.exp(q_a), 0.0))                # max(p - q, 0)
    resid = jnp.where(jnp.isfinite(jnp.max(resid, -1, keepdims=True)), resid, p_a)
    sampled = _draw(_key(sp, L + 1 + a, _RESIDUAL), resid)
    bonus = jnp.where(greedy, y[rows, a], sampled)
    out = jnp.concatenate([drafts, jnp.zeros((B, 1), jnp.int32)], 1)
    out = jnp.where(jnp.arange(K1)[None] == a[:, None], bonus[:, None], out)
    return a, out


def record_step(carry, out, a, logits, active, stop_ids, max_new):
    """Cut a step's committed run (out [B,k+1], a accepted drafts) at the first stop id and at the token budget,
    and record it. Returns (n_out [B], the updated carry fields: tokens, logprob, last, count, done — by stop or
    budget only —, steps, drafted, accepted, accepted_at). Any carry with those fields works (MTP, DSpark)."""
    B, K1 = out.shape
    k = K1 - 1
    j = jnp.arange(K1)[None]
    stops = jax.vmap(lambda o: is_stop(o, stop_ids))(out)
    first_stop = jnp.min(jnp.where(stops & (j <= a[:, None]), j, K1), axis=1)
    n_out = jnp.minimum(jnp.minimum(a + 1, first_stop + 1), max_new - carry.count)
    n_out = jnp.where(active, n_out, 0)
    rows = jnp.arange(B)[:, None]
    at = jnp.where(j < n_out[:, None], carry.count[:, None] + j, carry.tokens.shape[1])
    lp = jax.vmap(lambda lg, t: token_logprobs(lg, t, 0)[0], in_axes=1, out_axes=1)(logits, out)
    count = carry.count + n_out
    took = jnp.minimum(a, n_out)
    return n_out, dict(
        tokens=carry.tokens.at[rows, at].set(out, mode="drop"), logprob=carry.logprob.at[rows, at].set(lp, mode="drop"),
        last=jnp.where(n_out > 0, out[jnp.arange(B), jnp.maximum(n_out - 1, 0)], carry.last), count=count,
        done=carry.done | (first_stop < n_out) | (count >= max_new), steps=carry.steps + 1,
        drafted=carry.drafted + jnp.where(active, k, 0), accepted=carry.accepted + took,
        accepted_at=carry.accepted_at + (jnp.arange(k)[None] < took[:, None]).astype(jnp.int32))


@functools.partial(jax.jit, static_argnames=("cfg", "k", "max_steps", "max_seq"), donate_argnames=("carry",))
def spec_steps(params, carry: SpecCarry, sp: SamplingParams, stop_ids, max_new, forced, oracle=None, *,
               cfg: ModelConfig, k: int, max_steps: int, max_seq: int) -> SpecCarry:
    """Up to `max_steps` draft-verify steps on the device (fewer when every row is done)."""
    K1 = k + 1

    def step(carry):
        active = ~carry.done
        st = carry.state
        L = st.lengths
        drafts, qs, ring = draft(params, cfg, carry, sp, k)
        if oracle is not None:
            drafts, qs = oracle_draft(oracle, carry, sp, k, cfg.vocab_size)
        chunk = jnp.concatenate([carry.last[:, None], drafts], 1)                 # positions L..L+k
        h, _, pendings = forward_hidden_chunk(params, cfg, chunk, st, jnp.where(active, K1, 0), with_pending=True)
        logits = gather_vocab(head_logits(h, params, cfg, params.hc_head, params.norm), cfg.sharding)  # [B,k+1,V]
        a, out = accept(logits, drafts, qs, sp, L, forced, carry.steps)
        n_out, record = record_step(carry, out, a, logits, active, stop_ids, max_new)
        state = commit_chunk(params, cfg, st, pendings, n_out)
        state = dataclasses.replace(state, mtp=(ring,))
        return dataclasses.replace(
            carry, state=state, done=record.pop("done") | (state.lengths + K1 > max_seq),
            pend_h=jnp.where((n_out > 0)[:, None, None, None], h.astype(carry.pend_h.dtype), carry.pend_h),
            pend_tok=jnp.where((n_out > 0)[:, None], out, carry.pend_tok),
            pend_n=jnp.where(n_out > 0, n_out, carry.pend_n), **record)

    return run_until_done(step, carry, max_steps)
