"""The compiled programs the slot engine runs besides the decode loops themselves (`dsjax.decode.decode_steps`,
`dsjax.speculative.spec_steps`): rows joining, and one prefill chunk with the first token of the rows whose
prompt ends in it (V4.1's replay schedule: `dsjax.v41_replay.encode_chunk41` per chunk, then `replay_end`). Each
is jitted once per engine configuration; shapes never depend on the requests."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from dsjax.config import ModelConfig
from dsjax.model import forward_hidden_chunk, head_logits
from dsjax.mtp import mtp_hidden
from dsjax.sampling import Penalties, SamplingParams, counted, penalised, sample, token_logprobs
from dsjax.sharding import gather_vocab
from dsjax.state import init_state


@functools.partial(jax.jit, static_argnames=("cfg", "max_seq", "with_mtp"), donate_argnames=("state", "counts"))
def join_rows(state, counts, reset, clear, *, cfg: ModelConfig, max_seq: int, with_mtp: bool):
    """Rows joining: state rows where `reset` back to an empty cache (the others bit for bit untouched, including
    rows that start from a cached prefix), output-token counts [B, V] zeroed where `clear`."""
    fresh = init_state(cfg, reset.shape[0], max_seq, with_mtp=with_mtp)

    def pick(old, new):
        return jnp.where(reset.reshape(reset.shape + (1,) * (old.ndim - 1)), new, old)

    return jax.tree.map(pick, state, fresh), jnp.where(clear[:, None], 0, counts)


@functools.partial(jax.jit, static_argnames=("cfg", "K", "mtp"), donate_argnames=("state",))
def prefill(params, tokens, next_tokens, state, n_valid, n_mtp, ends, sp: SamplingParams, pen: Penalties | None,
            image=None, *, cfg: ModelConfig, K: int, mtp: bool):
    """One prompt chunk tokens [B, C] for the rows with n_valid > 0, and a first token sampled at each row's last
    valid position (what `generate` samples after the prompt: same position, same key), counted in `pen` for the
    rows that `ends`. Only the last position's logits are computed — a whole chunk's [B, C, vocab] would dwarf
    everything else. With `mtp`, the MTP block also consumes the n_mtp positions whose next token (next_tokens)
    is known, and the last position's streams come back for the first draft."""
    B, C = tokens.shape
    start = state.lengths
    h, state = forward_hidden_chunk(params, cfg, tokens, state, n_valid, image=image)
    if mtp:
        _, ring = mtp_hidden(params, cfg, h, next_tokens, state.mtp[0], start, n_mtp)
        state = dataclasses.replace(state, mtp=(ring,))
    rows = jnp.arange(B)
    last_h = h[rows, jnp.clip(n_valid - 1, 0, C - 1)]
    logits = head_logits(last_h[:, None], params, cfg, params.hc_head, params.norm)[:, 0]
    tok, lp, top_ids, top_lp, pen = _first_token(gather_vocab(logits, cfg.sharding), state.lengths, ends, sp, pen, K)
    return state, tok, lp, top_ids, top_lp, (last_h if mtp else None), pen


def _first_token(logits, lengths, ends, sp: SamplingParams, pen: Penalties | None, K: int):
    """The first token of each row at its last prompt position (as `generate` samples it), its logprob and top-K
    alternatives, and the penalties' counts with it for the rows that `ends`."""
    tok = sample(penalised(logits, pen), sp, lengths)
    lp, top_ids, top_lp = token_logprobs(logits, tok, K)
    return tok, lp, top_ids, top_lp, counted(pen, tok, ends)


@functools.partial(jax.jit, static_argnames=("cfg", "K"), donate_argnames=("state",))
def replay_end(params, state, keep, first, window_from, ends, sp: SamplingParams, pen: Penalties | None, *,
               cfg: ModelConfig, K: int):
    """The replay schedule's last step for the rows that `ends` (dsjax.v41_replay): the decoder layers over each
    such row's kept positions [first, lengths), then its first token sampled at the last prompt position as
    `prefill` samples it. Other rows replay nothing (first = their length) and keep their state bit for bit."""
    from dsjax.v41_replay import last_logits, replay41

    first = jnp.where(ends, first, state.lengths)
    y, _, state = replay41(params, state, keep, first, jnp.where(ends, window_from, state.lengths), cfg=cfg)
    logits = gather_vocab(last_logits(params, cfg, y, state.lengths, first), cfg.sharding)
    return (state, *_first_token(logits, state.lengths, ends, sp, pen, K))
