"""The V4 forward pass as a pure function: weights, config and token ids in, logits out.

`forward_hidden` returns the residual streams before `hc_head` (the MTP head's input); `logits` applies
hc_head, the final norm and the fp32 head. This is the full-sequence (prefill from position 0) form; the
fixed-shape decode state arrives with the decode loop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsjax.config import ModelConfig
from dsjax.layers.attention import attention_prefill
from dsjax.layers.hyper_connections import hc_head, hc_post, hc_pre
from dsjax.layers.moe import moe
from dsjax.layers.norms import rms_norm
from dsjax.weights import Block, Model


def block_forward(h, token_ids, w: Block, cfg: ModelConfig, layer: int):
    """One block on the n hyper-connection streams h [b,s,n,D]."""
    residual = h
    x, post, comb = hc_pre(h, w.hc_attn, cfg)
    x = attention_prefill(rms_norm(x, w.attn_norm, cfg.norm_eps), w.attn, cfg, layer)
    h = hc_post(x, residual, post, comb)
    residual = h
    x, post, comb = hc_pre(h, w.hc_ffn, cfg)
    x = moe(rms_norm(x, w.ffn_norm, cfg.norm_eps), token_ids, w.ffn, cfg)
    return hc_post(x, residual, post, comb)


def embed(params: Model, cfg: ModelConfig, token_ids):
    dt = jnp.dtype(cfg.compute_dtype)
    h = params.embed[token_ids].astype(dt)
    return jnp.repeat(h[:, :, None, :], cfg.hc_mult, axis=2)


def forward_hidden(params: Model, cfg: ModelConfig, token_ids):
    """token_ids [b,s] -> residual streams [b,s,n,D] after the last block (before hc_head)."""
    h = embed(params, cfg, token_ids)
    for layer, w in enumerate(params.layers):
        h = block_forward(h, token_ids, w, cfg, layer)
    return h


def head_logits(h, params: Model, cfg: ModelConfig, hc, norm_w):
    """hc_head -> RMSNorm -> fp32 head. h [b,s,n,D] -> [b,s,V] float32."""
    y = rms_norm(hc_head(h, hc, cfg), norm_w, cfg.norm_eps)
    return jnp.einsum("bsd,vd->bsv", y.astype(jnp.float32), params.head.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


def forward(params: Model, cfg: ModelConfig, token_ids, positions=None):
    """Logits float32 [b, s, V], or [b, len(positions), V] when `positions` (static ints) are given."""
    h = forward_hidden(params, cfg, token_ids)
    if positions is not None:
        h = h[:, jnp.asarray(positions)]
    return head_logits(h, params, cfg, params.hc_head, params.norm)
