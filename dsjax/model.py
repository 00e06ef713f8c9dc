"""The V4 forward pass as a pure function: weights, config, tokens and decode state in; logits and state out.

`forward_chunk` advances a batch of rows by one chunk — a prompt chunk, one decode token, or a verify block —
each row at its own position (`state.lengths`), the first `n_valid[b]` tokens real. `forward` is the
full-sequence special case (one chunk from an empty state). `hidden` outputs are the residual streams before
hc_head (the MTP head's input).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dsjax.config import ModelConfig
from dsjax.layers.attention import attention, commit_layer
from dsjax.layers.hyper_connections import hc_head, hc_post, hc_pre
from dsjax.layers.lm_head import lm_head
from dsjax.layers.moe import moe
from dsjax.layers.norms import rms_norm
from dsjax.layers.rows import per_token
from dsjax.sharding import active_mesh, axis_size, constrain, constrain_batch, local_ids
from dsjax.state import DecodeState, LayerState, init_state
from dsjax.weights import Block, Model


def block_forward(h, token_ids, w: Block, cfg: ModelConfig, layer: int, st: LayerState, start, n_valid,
                  *, with_pending: bool = False):
    """One block on the n hyper-connection streams h [b,t,n,D]. Returns (h, new layer state) — and the
    attention's pending inputs (see `commit_layer`) when `with_pending`."""
    def attn_input(h):
        x, post, comb = hc_pre(h, w.hc_attn, cfg)
        return rms_norm(x, w.attn_norm, cfg.norm_eps), post, comb

    def ffn_part(x, residual, post, comb, ids):
        h = hc_post(x, residual, post, comb)
        y, post, comb = hc_pre(h, w.hc_ffn, cfg)
        y = moe(rms_norm(y, w.ffn_norm, cfg.norm_eps), ids, w.ffn, cfg)
        return hc_post(y, h, post, comb)

    x, post, comb = per_token(cfg, attn_input, h)
    x, st, pending = attention(x, w.attn, cfg, layer, st, start, n_valid)
    out = per_token(cfg, ffn_part, x, h, post, comb, token_ids)
    return (out, st, pending) if with_pending else (out, st)


def embed_rows(table, token_ids, cfg: ModelConfig):
    """table[token_ids]; vocab-parallel under a mesh: each shard looks up its own rows, zeros elsewhere, and a
    psum (exact: one non-zero term) assembles them — the table is never gathered."""
    mesh = active_mesh()
    vocab = cfg.sharding.mesh_axes("vocab")
    if mesh is None or axis_size(mesh, vocab) == 1:
        return table[token_ids]

    def local(table, ids):
        ids, mine = local_ids(ids, vocab, table.shape[0])
        return jax.lax.psum(jnp.where(mine[..., None], table[ids], 0), vocab)

    batch = cfg.sharding.spec(("batch",))
    return jax.shard_map(local, in_specs=(P(vocab), batch), out_specs=batch, check_vma=False)(table, token_ids)


def token_rows(params: Model, cfg: ModelConfig, token_ids):
    """Token ids -> rows of the embedding (and hash-routing tables): the ids themselves for a full vocabulary;
    with a reduced one (`cfg.head_vocab_size`) the row holding each id, the last (reserved) row for the rest."""
    if not cfg.head_vocab_size:
        return token_ids
    R = cfg.head_vocab_size
    rows = jnp.full((cfg.vocab_size,), R - 1, jnp.int32).at[params.vocab_ids].set(
        jnp.arange(R, dtype=jnp.int32), mode="drop")  # the reserved row's id is vocab_size: dropped
    return rows[token_ids]


def scatter_vocab(row_logits, params: Model, cfg: ModelConfig):
    """[.., head_vocab_size] logits of a reduced head -> [.., vocab_size]: −inf at every unmapped id."""
    full = jnp.full(row_logits.shape[:-1] + (cfg.vocab_size,), -jnp.inf, row_logits.dtype)
    return full.at[..., params.vocab_ids].set(row_logits, mode="drop")


def embed(params: Model, cfg: ModelConfig, token_ids):
    dt = jnp.dtype(cfg.compute_dtype)
    h = embed_rows(params.embed, token_ids, cfg).astype(dt)
    return jnp.repeat(h[:, :, None, :], cfg.hc_mult, axis=2)


def forward_hidden_chunk(params: Model, cfg: ModelConfig, token_ids, state: DecodeState, n_valid=None,
                         *, with_pending: bool = False, image=None):
    """token_ids [B,T] at positions state.lengths[b]+t -> (streams [B,T,n,D] before hc_head, new state), plus
    every layer's pending inputs when `with_pending` (to commit a shorter prefix with `commit_chunk`).
    V4.1 (`v41_model`): the final collapsed stream [B,T,D] instead of the streams."""
    if cfg.family == "v4.1":
        if with_pending:
            raise NotImplementedError(f"{cfg.name}: V4.1 verify blocks (commit_chunk) are not written yet")
        from dsjax.v41_model import forward_hidden41
        return forward_hidden41(params, cfg, token_ids, state, n_valid, image=image)
    if image is not None:
        raise ValueError(f"{cfg.name}: images need a V4.1 model with a vision tower")
    B, T = token_ids.shape
    n_valid = jnp.full((B,), T, jnp.int32) if n_valid is None else n_valid.astype(jnp.int32)
    start = state.lengths
    token_ids = token_rows(params, cfg, token_ids)  # embedding and hash routing read rows
    streams = ("batch", None, None, None)  # activations replicated over tp between the blocks
    h = constrain(embed(params, cfg, token_ids), cfg.sharding, streams)
    layers, pendings = [], []
    for layer, (w, st) in enumerate(zip(params.layers, state.layers)):
        with jax.named_scope(f"layer{layer}"):  # readable profiles; tests count collectives per layer
            h, st, pending = block_forward(h, token_ids, w, cfg, layer, st, start, n_valid, with_pending=True)
            h = constrain(h, cfg.sharding, streams)
        layers.append(st)
        pendings.append(pending)
    new = constrain_batch(DecodeState(lengths=start + n_valid, layers=tuple(layers), mtp=state.mtp), cfg.sharding)
    return (h, new, tuple(pendings)) if with_pending else (h, new)


def commit_chunk(params: Model, cfg: ModelConfig, state: DecodeState, pendings, n_valid) -> DecodeState:
    """The state after only the first n_valid[b] tokens of a chunk run on `state` (see `commit_layer`)."""
    start = state.lengths
    layers = tuple(commit_layer(x, kv, w.attn, cfg, layer, st, start, n_valid)
                   for layer, (w, st, (x, kv)) in enumerate(zip(params.layers, state.layers, pendings)))
    return DecodeState(lengths=start + n_valid, layers=layers, mtp=state.mtp)


def head_logits(h, params: Model, cfg: ModelConfig, hc, norm_w):
    """hc_head -> RMSNorm -> fp32 head. h [b,s,n,D] -> [b,s,V] float32 (V4.1: h is already collapsed).
    A reduced vocabulary's rows are scattered into all V columns, −inf elsewhere."""
    if cfg.family == "v4.1":
        from dsjax.v41_model import head_logits41
        return head_logits41(h, params, cfg)
    logits = head_rows(h, params, cfg, hc, norm_w)
    return scatter_vocab(logits, params, cfg) if cfg.head_vocab_size else logits


def head_rows(h, params: Model, cfg: ModelConfig, hc, norm_w, head_method: str = "auto"):
    """V4's head over its own rows: [b,s,V] for a full vocabulary, [b,s,head_vocab_size] for a reduced one.
    `head_method`: `lm_head`'s (training asks for "fp32")."""
    def head(h):
        y = rms_norm(hc_head(h, hc, cfg), norm_w, cfg.norm_eps)
        return lm_head(y, params.head, head_method)

    return per_token(cfg, head, h)


def forward_chunk(params: Model, cfg: ModelConfig, token_ids, state: DecodeState, n_valid=None):
    """Logits float32 [B,T,V] of one chunk, and the advanced state."""
    h, state = forward_hidden_chunk(params, cfg, token_ids, state, n_valid)
    return head_logits(h, params, cfg, params.hc_head, params.norm), state


def forward(params: Model, cfg: ModelConfig, token_ids, positions=None, max_seq: int | None = None):
    """Full-sequence logits float32 [b, s, V] (or [b, len(positions), V] for static `positions`).

    `max_seq` sizes the caches as generation does (default: s); results then match generation's exactly.
    """
    b, s = token_ids.shape
    h, _ = forward_hidden_chunk(params, cfg, token_ids, init_state(cfg, b, max(s, max_seq or s)))
    if positions is not None:
        h = h[:, jnp.asarray(positions)]
    return head_logits(h, params, cfg, params.hc_head, params.norm)
