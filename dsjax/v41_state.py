"""Fixed-shape V4.1 decode state: per-layer window rings, the KV sources' caches, the Engram token history.

Only KV-source layers (spec §2.2: 2, 8, 14 at ratio 2 and 20 at ratio 1) own compressed caches; Reuse and
Reindex layers read their source's. Positions are implicit as in `state.py`: ring slot s holds the latest
position p < length with p ≡ s (mod window); compressed entry j (tokens [j·ratio, (j+1)·ratio)) sits at row j.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from dsjax.config import ModelConfig
from dsjax.weights import pytree


@pytree
class SourceState41:
    kv: Optional[jax.Array]      # f32 [B, ratio, d]: projected kv of the open group's positions (slot p % ratio); None at ratio 1
    score: Optional[jax.Array]   # f32 [B, ratio, d]: their gate scores (-inf before position 0)
    entries: jax.Array           # [B, max_seq // ratio, d]: compressed main KV (rotated, FP4-rounded; 288-B rows, v41_rows)
    index_keys: jax.Array        # [B, max_seq // ratio, index_dim]: index keys (rotated, FP4-rounded; 68-B rows)


@pytree
class LayerState41:
    window: jax.Array                  # [B, window, d] ring of the layer's KV latent (528-B FP8 rows, v41_rows)
    source: Optional[SourceState41]    # KV-source layers only


@pytree
class State41:
    lengths: jax.Array          # int32 [B]: tokens already cached
    layers: tuple               # LayerState41 per backbone layer
    engram_history: jax.Array   # int32 [B, max_ngram-1]: the last token ids (engram_pad_id before the start)


def init_state41(cfg: ModelConfig, batch: int, max_seq: int) -> State41:
    from dsjax.layers.engram import initial_history
    from dsjax.v41_rows import row_shapes
    from dsjax.v41_weights import owns_compressor

    d, rows = cfg.head_dim, row_shapes(cfg)
    (wd, wdt), (md, mdt), (idd, idt) = rows["window"], rows["main"], rows["index"]
    layers = []
    for layer in range(cfg.n_layers):
        source = None
        if owns_compressor(cfg, layer):
            ratio = cfg.layer_ratio(layer)
            buf = ((jnp.zeros((batch, ratio, d), jnp.float32), jnp.full((batch, ratio, d), -jnp.inf, jnp.float32))
                   if ratio > 1 else (None, None))
            source = SourceState41(kv=buf[0], score=buf[1], entries=jnp.zeros((batch, max_seq // ratio, md), mdt),
                                   index_keys=jnp.zeros((batch, max_seq // ratio, idd), idt))
        layers.append(LayerState41(window=jnp.zeros((batch, cfg.window_size, wd), wdt), source=source))
    return State41(lengths=jnp.zeros((batch,), jnp.int32), layers=tuple(layers),
                   engram_history=initial_history(cfg, batch))
