"""V4's multi-token-prediction head: one extra block that drafts the token after next.

At position i it takes the main model's residual streams before hc_head (h_i, [n, D]) and the token at i+1, and
predicts the token at i+2 with the shared embedding and head. Chaining it on its own pre-hc_head output drafts
k tokens (what engines do with the single released MTP layer). It keeps its own window ring; its rope is the
window layers' (θ = 10000, no YaRN) at the main model's position i.
"""

from __future__ import annotations

import jax.numpy as jnp

from dsjax.config import ModelConfig
from dsjax.layers.linear import linear
from dsjax.layers.norms import rms_norm
from dsjax.model import block_forward, embed_rows, head_logits, token_rows
from dsjax.numerics import round_to
from dsjax.state import LayerState
from dsjax.weights import MTP, Model


def mtp_hidden(params: Model, cfg: ModelConfig, h, next_tokens, st: LayerState, start, n_valid, *, depth: int = 0):
    """h [B,T,n,D] (streams before hc_head at positions start+t), next_tokens [B,T] (tokens at start+t+1)
    -> (the MTP block's output streams [B,T,n,D], its new window state)."""
    w: MTP = params.mtp[depth]
    dt = jnp.dtype(cfg.compute_dtype)
    next_tokens = token_rows(params, cfg, next_tokens)
    e = rms_norm(embed_rows(params.embed, next_tokens, cfg).astype(dt), w.enorm, cfg.norm_eps)
    x = rms_norm(h, w.hnorm, cfg.norm_eps)
    z = round_to(linear(e, w.e_proj, cfg)[:, :, None, :].astype(jnp.float32)
                 + linear(x, w.h_proj, cfg).astype(jnp.float32), dt)
    return block_forward(z, next_tokens, w.block, cfg, cfg.n_layers + depth, st, start, n_valid)


def mtp_logits(params: Model, cfg: ModelConfig, z, *, depth: int = 0):
    """Draft logits float32 [B,T,V] from the MTP block's output streams (its own hc_head and norm, shared head)."""
    w: MTP = params.mtp[depth]
    return head_logits(z, params, cfg, w.hc_head, w.norm)
