"""V4.1's production prompt schedule: CED prefill with SWA bounded replay (spec §3.9, tech report §2.2).

The exact schedule runs every layer for every prompt token. V4.1's layers form a causal encoder-decoder: the
decoder layers (from the ratio-1 KV source, layer 20 of 40, on) read only their own sliding window and that
source's compressed cache, which the source computes from its attention input alone. So:

1. `encode_chunk41`, chunk by chunk: the encoder layers for every prompt token, then the ratio-1 source's
   compressor and index keys (the decoder's whole global KV and index-key cache); the stream at each row's last
   `window` prompt positions is kept;
2. `replay41`, once: the decoder layers for those last `window` positions only — rebuilding each decoder layer's
   window ring — and the first logits.

Decoder work per prompt drops from S tokens to `window` (128). The replayed tokens see a truncated window (no
decoder keys before the replay start), so the logits differ from the exact schedule's (docs/numerics.md measures by
how much); a prompt no longer than the window is replayed whole and matches it. After the replay every state
the decode loop reads is complete: encoder rings and caches exact, decoder rings full (W replayed positions).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from dsjax.config import ConfigError, ModelConfig
from dsjax.layers.csa2 import update_source
from dsjax.layers.engram import hash_ids, next_history
from dsjax.layers.rows import per_token
from dsjax.v41_model import attention_input, collapse, embed41, head_logits41, new_shared, run_layers41
from dsjax.v41_state import LayerState41, State41

SCHEDULES = ("exact", "replay")   # generate(prefill_schedule=...): every layer for every token, or this one


def decoder_start(cfg: ModelConfig) -> int:
    """The first decoder layer: the ratio-1 KV source (20 in V4.1-Flash). Engram layers must all be encoder
    layers (a decoder Engram would need the hashes of positions that are never replayed)."""
    ones = [l for l in cfg.kv_source_layers if cfg.layer_ratio(l) == 1]
    if cfg.family != "v4.1" or not ones:
        raise ConfigError(f"{cfg.name}: the replay prefill needs a V4.1 model with a ratio-1 KV source")
    E = ones[0]
    if any(l >= E for l in cfg.engram_layer_ids):
        raise ConfigError(f"{cfg.name}: Engram layers {cfg.engram_layer_ids} reach the decoder (from layer {E})")
    return E


def replay_from(lengths, window: int):
    """Each row's first replayed position: its last `window` prompt tokens (all of a shorter prompt)."""
    return jnp.maximum(lengths - window, 0).astype(jnp.int32)


def empty_keep(cfg: ModelConfig, batch: int):
    """Buffers of the stream at the replayed positions: (h [B,W,n,D], pre_mix [B,W,n], token ids [B,W], image-span
    positions bool [B,W])."""
    W, n = cfg.window_size, cfg.hc_mult
    return (jnp.zeros((batch, W, n, cfg.dim), jnp.dtype(cfg.compute_dtype)),
            jnp.zeros((batch, W, n), jnp.float32), jnp.zeros((batch, W), jnp.int32), jnp.zeros((batch, W), bool))


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("state", "keep"))
def encode_chunk41(params, token_ids, state: State41, n_valid, keep, first, image=None, *, cfg: ModelConfig):
    """One prompt chunk through the encoder and the ratio-1 source; `first` [B] = replay_from(prompt lengths);
    `image` as `forward_hidden41` takes it (image-span rows and their index; the decoder layers see the span's
    positions again through `keep`). Returns (state with every encoder layer, the source and the Engram history
    advanced, keep updated)."""
    E = decoder_start(cfg)
    B, T = token_ids.shape
    start = state.lengths
    image_mask = None if image is None else image[1] >= 0
    row_ids = hash_ids(cfg, state.engram_history, token_ids, image_mask) if cfg.engram_layer_ids else None
    h, pre_mix = embed41(params, cfg, token_ids, image)
    h, pre_mix, layers, _, _ = run_layers41(params, cfg, h, pre_mix, token_ids, state, start, n_valid, range(E),
                                            new_shared(state), image_mask=image_mask, row_ids=row_ids)
    w, st = params.layers[E], state.layers[E]
    x = per_token(cfg, lambda h, p: attention_input(h, p, w, cfg), h, pre_mix)
    layers[E] = LayerState41(window=st.window, source=update_source(x, w.attn, st.source, cfg, E, start, n_valid))
    t = jnp.arange(T)[None, :]
    slot = start[:, None] + t - first[:, None]
    slot = jnp.where((slot >= 0) & (t < n_valid[:, None]), slot, cfg.window_size)      # out of range: dropped
    rows = jnp.arange(B)[:, None]
    is_image = jnp.zeros((B, T), bool) if image_mask is None else image_mask
    keep = tuple(k.at[rows, slot].set(v.astype(k.dtype), mode="drop")
                 for k, v in zip(keep, (h, pre_mix, token_ids, is_image)))
    history = next_history(state.engram_history, token_ids, n_valid, image_mask)
    return State41(lengths=start + n_valid, layers=tuple(layers), engram_history=history), keep


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("state",))
def replay41(params, state: State41, keep, first, window_from=None, *, cfg: ModelConfig):
    """The decoder layers over each row's kept positions [first, lengths). Returns (y [B,W,D] the collapsed
    stream there, the DSpark taps [B,W,.] or None, the complete state). `window_from` [B]: the first position
    whose decoder-layer window rows exist (default `first`; lower when a row continues a cached state whose
    decoder windows hold the positions just before `first`)."""
    E = decoder_start(cfg)
    h, pre_mix, tokens, is_image = keep
    n = state.lengths - first
    shared = new_shared(state)
    shared["window_from"] = first if window_from is None else window_from
    h, pre_mix, layers, _, taps = run_layers41(params, cfg, h, pre_mix, tokens, state, first, n,
                                               range(E, cfg.n_layers), shared, image_mask=is_image)
    y = per_token(cfg, collapse, h, pre_mix)
    taps = jnp.concatenate(taps, axis=-1) if taps else None
    return y, taps, dataclasses.replace(state, layers=tuple(layers))


def prefill_replay(params, cfg: ModelConfig, chunks, state: State41, lengths):
    """The whole schedule for a batch of prompts already cut into chunks (token ids [B, C], n_valid [B] and the
    chunk's image argument or None, every row from position 0). Returns (y [B,W,D] at the replayed positions,
    taps, first, state)."""
    first = replay_from(jnp.asarray(lengths, jnp.int32), cfg.window_size)
    keep = empty_keep(cfg, state.lengths.shape[0])
    for tokens, n_valid, image in chunks:
        state, keep = encode_chunk41(params, tokens, state, n_valid, keep, first, image, cfg=cfg)
    y, taps, state = replay41(params, state, keep, first, cfg=cfg)
    return y, taps, first, state


def last_logits(params, cfg: ModelConfig, y, lengths, first):
    """Logits [B, V] at each row's last prompt position from the replayed stream."""
    last = (jnp.asarray(lengths) - 1 - first).astype(jnp.int32)
    return head_logits41(y[jnp.arange(y.shape[0]), last][:, None], params, cfg)[:, 0]
