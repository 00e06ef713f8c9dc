"""The on-device generate loop: many decode steps per dispatch inside one `lax.while_loop`.

The loop carries only fixed-shape arrays — the decode state, the last token per row, a static token buffer,
per-row counts and done masks — so one compile serves every step, and the host sees tokens once per dispatch.
A finished row stops advancing (its chunk has no valid token), so its caches are left exactly as they were.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from dsjax.config import ModelConfig
from dsjax.model import forward_chunk
from dsjax.sharding import gather_vocab
from dsjax.sampling import Penalties, SamplingParams, counted, penalised, sample, token_logprobs
from dsjax.state import DecodeState
from dsjax.weights import pytree


@pytree
class LoopCarry:
    state: DecodeState
    last: jax.Array       # int32 [B]: the newest token of each row, not yet fed to the model
    tokens: jax.Array     # int32 [B, N]: generated tokens (the first one comes from the prefill)
    logprob: jax.Array    # f32 [B, N]: log-probability of each generated token (raw model distribution)
    top_ids: jax.Array    # int32 [B, N, K]
    top_lp: jax.Array     # f32 [B, N, K]
    count: jax.Array      # int32 [B]: tokens generated so far
    done: jax.Array       # bool [B]
    steps: jax.Array      # int32 []: model steps run so far (all dispatches)
    penalties: Penalties | None = None  # presence/frequency/logit_bias with output counts (serving); None: off


def is_stop(tokens, stop_ids):
    return jnp.any(tokens[:, None] == stop_ids[None, :], axis=-1) if stop_ids.shape[0] else jnp.zeros(tokens.shape, bool)


def record(carry: LoopCarry, tok, logits, K: int, active) -> LoopCarry:
    """Append `tok` to the rows that are `active` (at their own count)."""
    B, N = carry.tokens.shape
    lp, ids, tlp = token_logprobs(logits, tok, K)
    rows = jnp.arange(B)
    at = jnp.where(active, carry.count, N)  # out of range -> dropped
    return dataclasses.replace(
        carry, last=jnp.where(active, tok, carry.last),
        tokens=carry.tokens.at[rows, at].set(tok, mode="drop"),
        logprob=carry.logprob.at[rows, at].set(lp, mode="drop"),
        top_ids=carry.top_ids.at[rows, at].set(ids, mode="drop"),
        top_lp=carry.top_lp.at[rows, at].set(tlp, mode="drop"),
        count=carry.count + active.astype(jnp.int32), penalties=counted(carry.penalties, tok, active))


def finish_flags(carry: LoopCarry, tok, active, stop_ids, max_new, max_seq: int):
    """Rows end on a stop id, at their max_new_tokens, or when their cache is full."""
    stopped = active & is_stop(tok, stop_ids)
    full = carry.state.lengths + 1 >= max_seq
    return carry.done | stopped | (carry.count >= max_new) | full


@functools.partial(jax.jit, static_argnames=("cfg", "max_steps", "K", "max_seq"), donate_argnames=("carry",))
def decode_steps(params, carry: LoopCarry, sp: SamplingParams, stop_ids, max_new, *, cfg: ModelConfig,
                 max_steps: int, K: int, max_seq: int) -> LoopCarry:
    """Run up to `max_steps` decode steps on the device (fewer when every row is done)."""

    def step(carry):
        active = ~carry.done
        logits, state = forward_chunk(params, cfg, carry.last[:, None], carry.state, active.astype(jnp.int32))
        logits = gather_vocab(logits[:, 0], cfg.sharding)
        tok = sample(penalised(logits, carry.penalties), sp, carry.state.lengths + 1)
        carry = record(dataclasses.replace(carry, state=state, steps=carry.steps + 1), tok, logits, K, active)
        return dataclasses.replace(carry, done=finish_flags(carry, tok, active, stop_ids, max_new, max_seq))

    return run_until_done(step, carry, max_steps)


def run_until_done(step, carry, max_steps: int):
    """Apply `step` on the device up to `max_steps` times, stopping early once every row's `done` is set."""

    def cond(c):
        i, carry = c
        return (i < max_steps) & ~jnp.all(carry.done)

    def body(c):
        i, carry = c
        return i + 1, step(carry)

    return jax.lax.while_loop(cond, body, (jnp.int32(0), carry))[1]
