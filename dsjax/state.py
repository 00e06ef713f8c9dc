"""Fixed-shape decode state for a batch of slots: window rings, compressor partial groups, compressed caches.

Every array has a static shape set by (batch, max_seq_len), so one compiled step serves every position; a row's
progress is the int32 `lengths[b]` (tokens already cached). Positions are implicit:

- window ring: slot s holds the latest position p < length with p ≡ s (mod window);
- compressor buffers: the projected kv/score of the last c·ratio positions, slot p mod (c·ratio) — enough to
  pool any group that completes in the next chunk (ratio-4 entries also need the previous group);
- compressed caches: entry j (tokens [j·ratio, (j+1)·ratio)) at row j, valid once length ≥ (j+1)·ratio.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from dsjax.config import ModelConfig
from dsjax.weights import pytree


@pytree
class CompressorState:
    kv: jax.Array       # f32 [B, c·ratio, c·d]: projected kv of the last c·ratio positions (slot p % (c·ratio))
    score: jax.Array    # f32 [B, c·ratio, c·d]: gate score + ape of the same positions (-inf before position 0)
    entries: jax.Array  # [B, max_seq // ratio, d]: finished entries (normed, rotated, fake-quantised)


@pytree
class LayerState:
    window: jax.Array                 # [B, window, d] ring of the layer's KV latent
    compressor: Optional[CompressorState]
    index: Optional[CompressorState]  # the indexer's own compressor (CSA layers): its entries are the index keys


@pytree
class DecodeState:
    lengths: jax.Array  # int32 [B]: tokens already in the caches (the next token's position)
    layers: tuple       # LayerState per backbone layer
    mtp: tuple = ()     # LayerState per MTP block (its own window ring), when drafting with MTP


def _compressor_state(batch: int, max_seq: int, ratio: int, d: int, row: tuple) -> CompressorState:
    c = 2 if ratio == 4 else 1
    return CompressorState(
        kv=jnp.zeros((batch, c * ratio, c * d), jnp.float32),
        score=jnp.full((batch, c * ratio, c * d), -jnp.inf, jnp.float32),
        entries=jnp.zeros((batch, max_seq // ratio, row[0]), row[1]),
    )


def _rows(cfg: ModelConfig, d: int, compact: bool, row_bytes: int):
    """(width, dtype) of one cache row: compact uint8 rows (kv_rows.py) or plain values."""
    return (row_bytes, jnp.uint8) if compact else (d, jnp.dtype(cfg.compute_dtype))


def init_state(cfg: ModelConfig, batch: int, max_seq: int, *, with_mtp: bool = False) -> DecodeState:
    """Empty caches for `batch` rows of up to `max_seq` tokens: compute-dtype values, or the compact rows of
    kv_rows.py (584-byte main KV, 68-byte index keys) for the V4 reference presets. V4.1: `v41_state.init_state41`."""
    if cfg.family == "v4.1":
        if with_mtp:
            raise NotImplementedError(f"{cfg.name}: V4.1 drafts with DSpark, whose decode state is not written yet")
        from dsjax.v41_state import init_state41
        return init_state41(cfg, batch, max_seq)
    from dsjax import kv_rows

    main = _rows(cfg, cfg.head_dim, kv_rows.main_rows_compact(cfg), kv_rows.main_row_bytes(cfg))
    idx = _rows(cfg, cfg.index_head_dim, kv_rows.index_rows_compact(cfg), kv_rows.index_row_bytes(cfg))
    layers = []
    for layer in range(cfg.n_layers):
        ratio = cfg.layer_ratio(layer)
        comp = _compressor_state(batch, max_seq, ratio, cfg.head_dim, main) if ratio else None
        index = _compressor_state(batch, max_seq, ratio, cfg.index_head_dim, idx) if cfg.layer_kind(layer) == "csa" else None
        window = jnp.zeros((batch, cfg.window_size, main[0]), main[1])
        layers.append(LayerState(window=window, compressor=comp, index=index))
    mtp = tuple(LayerState(window=jnp.zeros((batch, cfg.window_size, main[0]), main[1]), compressor=None, index=None)
                for _ in range(cfg.n_mtp_layers if with_mtp else 0))
    return DecodeState(lengths=jnp.zeros((batch,), jnp.int32), layers=tuple(layers), mtp=mtp)


def state_bytes(cfg: ModelConfig, batch: int, max_seq: int) -> int:
    shapes = jax.eval_shape(lambda: init_state(cfg, batch, max_seq))
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes)))
