"""Token sampling on the device: greedy, temperature, top-k, top-p, min-p; per-row settings and seeds.

Every control is an array with one entry per row, so one compiled step serves a batch that mixes greedy and
sampled requests. A row with temperature 0 is greedy (argmax, ties to the lower id). Filters apply to the
temperature-scaled distribution in the order top-k, top-p, min-p (vLLM's order); the draw uses a per-row key
folded with the row's step, so a row's tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dsjax.errors import InputError
from dsjax.weights import pytree


@pytree
class SamplingParams:
    temperature: jax.Array  # f32 [B]; 0 = greedy
    top_k: jax.Array        # int32 [B]; 0 = off
    top_p: jax.Array        # f32 [B]; 1 = off
    min_p: jax.Array        # f32 [B]; 0 = off
    key: jax.Array          # uint32 [B, 2] raw PRNG keys, one per row


def make_sampling(batch: int, *, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0) -> SamplingParams:
    """Validate per-request values (scalars or one per row) and build the device arrays."""
    def per_row(v, name, dtype):
        a = np.asarray(v, dtype=np.float64)
        if a.ndim == 0:
            a = np.full((batch,), a)
        if a.shape != (batch,):
            raise InputError(f"{name}: expected a scalar or {batch} values, got shape {a.shape}")
        if not np.all(np.isfinite(a)):
            raise InputError(f"{name} must be finite, got {a.tolist()}")
        return a.astype(dtype)

    t = per_row(temperature, "temperature", np.float32)
    k = per_row(top_k, "top_k", np.int64)
    p = per_row(top_p, "top_p", np.float32)
    m = per_row(min_p, "min_p", np.float32)
    if (t < 0).any():
        raise InputError(f"temperature must be ≥ 0, got {t.tolist()}")
    if (k < 0).any() or (np.asarray(top_k, np.float64) % 1 != 0).any():
        raise InputError(f"top_k must be a non-negative integer (0 = off), got {np.asarray(top_k).tolist()}")
    if ((p <= 0) | (p > 1)).any():
        raise InputError(f"top_p must lie in (0, 1], got {p.tolist()}")
    if ((m < 0) | (m > 1)).any():
        raise InputError(f"min_p must lie in [0, 1], got {m.tolist()}")
    seeds = np.asarray(seed, dtype=np.int64)
    if seeds.ndim == 0:
        seeds = seeds + np.arange(batch)  # distinct streams per row from one seed
    if seeds.shape != (batch,):
        raise InputError(f"seed: expected an int or {batch} ints, got shape {seeds.shape}")
    keys = jnp.stack([jax.random.key_data(jax.random.PRNGKey(int(s) % 2**32)) for s in seeds])
    return SamplingParams(jnp.asarray(t), jnp.asarray(k.astype(np.int32)), jnp.asarray(p), jnp.asarray(m), keys)


@pytree
class Penalties:
    """OpenAI's presence / frequency penalties and logit_bias, per row, with the row's output-token counts:
    logits[j] + bias[j] - frequency * c[j] - presence * (c[j] > 0), where c[j] counts token j among the tokens
    the row generated so far (prompt tokens do not count). Applied before temperature and filters; the logprobs
    a request sees stay those of the raw model distribution (as vLLM's default)."""
    presence: jax.Array   # f32 [B]
    frequency: jax.Array  # f32 [B]
    bias: jax.Array       # f32 [B, V]
    counts: jax.Array     # int32 [B, V]


def penalised(logits, pen: Penalties | None):
    """logits [B,V] with the penalties and bias applied (unchanged when `pen` is None)."""
    if pen is None:
        return logits
    c = pen.counts.astype(jnp.float32)
    return (logits.astype(jnp.float32) + pen.bias - pen.frequency[:, None] * c
            - pen.presence[:, None] * (c > 0).astype(jnp.float32))


def counted(pen: Penalties | None, tokens, active):
    """`pen` with tokens [B] added to the counts of the `active` rows."""
    if pen is None:
        return None
    rows = jnp.arange(tokens.shape[0])
    return dataclasses.replace(pen, counts=pen.counts.at[rows, tokens].add(active.astype(jnp.int32)))


def filtered_logprobs(logits, sp: SamplingParams):
    """log-probabilities [B,V] of the distribution a row samples from (temperature + filters applied)."""
    V = logits.shape[-1]
    t = jnp.where(sp.temperature > 0, sp.temperature, 1.0)[:, None]
    scaled = logits.astype(jnp.float32) / t
    order = jnp.argsort(-scaled, axis=-1, stable=True)
    sorted_l = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(V)[None, :]
    keep = jnp.where(sp.top_k[:, None] > 0, rank < sp.top_k[:, None], True)
    probs = jax.nn.softmax(jnp.where(keep, sorted_l, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs           # mass strictly above this token
    keep &= before < sp.top_p[:, None]                     # smallest prefix whose mass reaches top_p
    keep &= probs >= sp.min_p[:, None] * probs[:, :1]      # min-p relative to the top token
    kept_sorted = jnp.where(keep, sorted_l, -jnp.inf)
    kept = jnp.full_like(scaled, -jnp.inf).at[jnp.arange(logits.shape[0])[:, None], order].set(kept_sorted)
    return jax.nn.log_softmax(kept, axis=-1)


def sample(logits, sp: SamplingParams, step):
    """One token per row: argmax where temperature is 0, else a draw from the filtered distribution.

    step: int32 [B] (the row's position), folded into its key so each position draws fresh randomness.
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    lp = filtered_logprobs(logits, sp)

    def draw(key_data, s, row_lp):
        key = jax.random.fold_in(jax.random.wrap_key_data(key_data), s)
        return jax.random.categorical(key, row_lp).astype(jnp.int32)

    drawn = jax.vmap(draw)(sp.key, step, lp)
    return jnp.where(sp.temperature > 0, drawn, greedy)


def token_logprobs(logits, tokens, k: int):
    """(logprob of the chosen token [B], top-k ids [B,k], top-k logprobs [B,k]) under the raw model distribution."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
    if k:
        top_lp, top_ids = jax.lax.top_k(lp, k)
    else:
        top_lp, top_ids = jnp.zeros((lp.shape[0], 0)), jnp.zeros((lp.shape[0], 0), jnp.int32)
    return chosen, top_ids.astype(jnp.int32), top_lp

