"""Speculative decoding with V4.1's DSpark draft on the device: draft a block -> verify k+1 positions in one target
forward -> accept -> commit, many steps per dispatch inside one `lax.while_loop` (`speculative="dspark"`).

Per row the carry holds the committed target state, the DSpark rings (the stages' KV of main_x for every committed
position) and main_x at the newest committed position L-1. A step:

1. Draft: the block [newest token, noise, ...] at positions L..L+S-1 through the three stages; k ≤ S drafts come
   out of the sequential Markov head (argmax, or a sample from the row's filtered distribution q — the chain's own
   conditional, so rejection sampling sees the drafter's true q).
2. Verify: the target runs [newest, d1..dk] at positions L..L+k, recording each layer's pending inputs and the taps.
3. Accept: `speculative.accept` (greedy prefix match, or lossless rejection sampling).
4. Commit: `commit_chunk41` re-derives the target state for the committed prefix only; the taps of the committed
   positions go into the rings. Unlike the MTP there is no catch-up: the verify pass computed the taps the next
   draft needs, causally, at exactly the committed positions.

Optional adaptive verification (`adaptive` = a confidence threshold): a row verifies drafts only up to the first
position whose confidence sigmoid falls below it — drafts beyond are not offered for acceptance. Shapes stay
fixed (the verify chunk is always k+1), so this trades acceptance for nothing on a single device; it is what an
engine with per-request verify lengths would schedule, measured here (docs in the issue note).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from dsjax import dspark
from dsjax.config import ModelConfig
from dsjax.decode import run_until_done
from dsjax.sampling import SamplingParams, filtered_logprobs
from dsjax.sharding import gather_vocab
from dsjax.speculative import _DRAFT, Forced, OracleDrafts, _draw, _key, accept, oracle_draft, record_step
from dsjax.v41_model import commit_chunk41, forward_hidden41, head_logits41
from dsjax.weights import pytree


@pytree
class DSparkCarry:
    state: object          # State41
    rings: tuple           # per stage [B, W, row]: KV of main_x at committed positions
    main_x: jax.Array      # [B, D]: main_x at position L-1
    last: jax.Array        # int32 [B]: the newest token (position L), not yet fed
    tokens: jax.Array      # int32 [B, N]
    logprob: jax.Array     # f32 [B, N]
    count: jax.Array       # int32 [B]
    done: jax.Array        # bool [B]
    steps: jax.Array       # int32 []
    drafted: jax.Array     # int32 [B]
    accepted: jax.Array    # int32 [B]
    accepted_at: jax.Array  # int32 [B, k]
    verified: jax.Array    # int32 [B]: drafts offered for verification (= drafted unless adaptive)


def draft(params, cfg: ModelConfig, carry: DSparkCarry, sp: SamplingParams, k: int, y=None):
    """Drafts [B,k], their filtered log-probabilities [B,k,V] (one-hot for greedy rows), confidence [B,k]."""
    L = carry.state.lengths
    greedy = sp.temperature <= 0
    qs = []

    def choose(i, logits):
        q = filtered_logprobs(logits, sp)
        qs.append(q)
        return jnp.where(greedy, jnp.argmax(logits, -1).astype(jnp.int32), _draw(_key(sp, L + 1 + i, _DRAFT), q))

    ids, _, conf = dspark.draft_block(params, cfg, carry.rings, carry.last, L - 1, choose, n=k, y=y)
    return ids[:, 1:], jnp.stack(qs, 1), conf


def verify_length(conf, threshold):
    """Drafts to verify per row [B]: those before the first position whose sigmoid(confidence) < threshold."""
    ok = jax.nn.sigmoid(conf) >= threshold
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)


@functools.partial(jax.jit, static_argnames=("cfg", "k", "max_steps", "max_seq"), donate_argnames=("carry",))
def dspark_steps(params, carry: DSparkCarry, sp: SamplingParams, stop_ids, max_new, forced: Forced | None,
                 oracle: OracleDrafts | None = None, adaptive=None, *, cfg: ModelConfig, k: int, max_steps: int,
                 max_seq: int) -> DSparkCarry:
    """Up to `max_steps` draft-verify steps on the device (fewer when every row is done)."""
    K1 = k + 1

    def step(carry: DSparkCarry):
        active = ~carry.done
        st = carry.state
        L = st.lengths
        drafts, qs, conf = draft(params, cfg, carry, sp, k)
        if oracle is not None:  # tests: a negative keep leaves the model's drafts (one compile serves both)
            o_drafts, o_qs = oracle_draft(oracle, carry, sp, k, cfg.vocab_size)
            drafts, qs = jnp.where(oracle.keep >= 0, o_drafts, drafts), jnp.where(oracle.keep >= 0, o_qs, qs)
        offered = jnp.full_like(L, k) if adaptive is None else verify_length(conf, adaptive)
        chunk = jnp.concatenate([carry.last[:, None], drafts], 1)                    # positions L..L+k
        rec = {}
        y, _ = forward_hidden41(params, cfg, chunk, st, jnp.where(active, K1, 0), record=rec)
        logits = gather_vocab(head_logits41(y, params, cfg), cfg.sharding)          # [B,k+1,V]
        a, out = accept(logits, drafts, qs, sp, L, forced, carry.steps, None if adaptive is None else offered)
        n_out, fields = record_step(carry, out, a, logits, active, stop_ids, max_new)
        state = commit_chunk41(params, cfg, st, rec["pending"], chunk, n_out)
        main_x = dspark.main_latent(params, cfg, rec["taps"])
        rows = jnp.arange(L.shape[0])
        return dataclasses.replace(
            carry, state=state, done=fields.pop("done") | (state.lengths + K1 > max_seq),
            rings=dspark.commit_rings(params, cfg, carry.rings, main_x, L, n_out),
            main_x=jnp.where((n_out > 0)[:, None], main_x[rows, jnp.maximum(n_out - 1, 0)], carry.main_x),
            verified=carry.verified + jnp.where(active, offered, 0), **fields)

    return run_until_done(step, carry, max_steps)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("state", "rings"))
def prefill_chunk(params, tokens, state, rings, n_valid, image=None, *, cfg: ModelConfig):
    """One prompt chunk through the target, its taps into the DSpark rings. Returns (logits, main_x, state, rings).
    `image`: the chunk's image-span rows (see forward_hidden41)."""
    start = state.lengths
    rec = {}
    y, state = forward_hidden41(params, cfg, tokens, state, n_valid, record=rec, image=image)
    rings, main_x = dspark.seed_from_chunk(params, cfg, rings, rec["taps"], start, n_valid)
    return head_logits41(y, params, cfg), main_x, state, rings
