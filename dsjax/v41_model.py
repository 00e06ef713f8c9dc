"""The V4.1 forward pass (spec §3.8): Engram, staggered single-pass mHC, CSA2 attention, MoE, no hc_head.

`forward_chunk41` advances every row of a batch by one chunk at its own position (`state.lengths[b]`), the first
`n_valid[b]` tokens real — prefill chunks and decode steps alike, as V4's `model.forward_chunk`. `forward41` is
the full-sequence case. Staggered mHC: each sub-layer's `pre` collapses the streams for the *next* sub-layer's
input, so a block takes and returns `pre_mix` [b,s,n] (one-hot on copy 0 before layer 0), and the final
collapse uses the last block's FFN `pre`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsjax.config import ModelConfig
from dsjax.layers.csa2 import attention41, commit_layer41
from dsjax.layers.engram import engram, engram_rows, hash_ids, next_history
from dsjax.layers.hyper_connections import _mixes, hc_post, mixes_split
from dsjax.layers.lm_head import lm_head
from dsjax.layers.moe import moe
from dsjax.layers.norms import rms_norm
from dsjax.layers.rows import per_token
from dsjax.numerics import materialize, round_to, sum_in_order
from dsjax.v41_state import State41, init_state41
from dsjax.v41_weights import Block41, Model41


def mixes(h, mix, cfg: ModelConfig):
    """(pre, post, comb) of one sub-layer from the stream h [b,s,n,D] (rsqrt statistic with norm_eps)."""
    _, m = _mixes(h, mix.fn, cfg.norm_eps)
    return mixes_split(m, mix, cfg, h.dtype)


def collapse(h, pre):
    """Σ_j pre_j·h_j in fp32 (torch's order over the copies), cast to h's dtype. h [b,s,n,D], pre [b,s,n]."""
    return round_to(sum_in_order(materialize(pre[..., None] * h.astype(jnp.float32)), axis=-2), h.dtype)


def attention_input(h, pre_mix, w: Block41, cfg: ModelConfig):
    """A block's normed attention input: the streams collapsed with the previous sub-layer's `pre` [b,s,D]."""
    return rms_norm(collapse(h, pre_mix), w.attn_norm, cfg.norm_eps)


def block41(h, pre_mix, token_ids, w: Block41, cfg: ModelConfig, layer: int, st, shared: dict, start, n_valid,
            attention=attention41, image_mask=None):
    """One V4.1 block. Returns (h [b,t,n,D], pre_mix for the next block, new layer state). `attention` has
    attention41's signature (the DSpark stages pass their block attention); `image_mask` [b,t]: image-span
    tokens, which the MoE routes with its VL bias."""
    def attn_input(h, pre_mix):
        pre, post, comb = mixes(h, w.hc_attn, cfg)
        return attention_input(h, pre_mix, w, cfg), pre, post, comb

    def ffn_part(x, residual, post, comb, attn_pre, ids, image=None):
        h = hc_post(x, residual, post, comb)
        ffn_pre, post, comb = mixes(h, w.hc_ffn, cfg)
        y = moe(rms_norm(collapse(h, attn_pre), w.ffn_norm, cfg.norm_eps), ids, w.ffn, cfg, image)
        return hc_post(y, h, post, comb), ffn_pre

    x, attn_pre, post, comb = per_token(cfg, attn_input, h, pre_mix)
    x, st = attention(x, w.attn, cfg, layer, st, shared, start, n_valid)
    extra = () if image_mask is None else (image_mask,)
    out, ffn_pre = per_token(cfg, ffn_part, x, h, post, comb, attn_pre, token_ids, *extra)
    return out, ffn_pre, st


def embed41(params: Model41, cfg: ModelConfig, token_ids, image=None):
    """Token embeddings repeated over the n streams [b,s,n,D], and the one-hot first pre_mix. `image` =
    (span_rows [R,D], index int32 [b,s]): where index >= 0 the row span_rows[index] replaces the embedding (the
    image spans' ViT/aligner rows and start/newline/end vectors, see dsjax.vision)."""
    from dsjax.model import embed_rows

    h = embed_rows(params.embed, token_ids, cfg)
    if image is not None:
        rows, index = image
        h = jnp.where((index >= 0)[..., None], rows[jnp.maximum(index, 0)].astype(h.dtype), h)
    h = h.astype(jnp.dtype(cfg.compute_dtype))
    h = jnp.repeat(h[:, :, None, :], cfg.hc_mult, axis=2)
    pre_mix = jnp.zeros(h.shape[:3], jnp.float32).at[..., 0].set(1.0)
    return h, pre_mix


def stream_mean(h):
    """The mean of the n streams [b,s,n,D] -> [b,s,D] in h's dtype (fp32 sum; /n exact for n = 4)."""
    return round_to(sum_in_order(h.astype(jnp.float32), axis=-2) / h.shape[-2], h.dtype)


def new_shared(state: State41) -> dict:
    """What a forward's layers publish to later layers: the KV sources' states, the last top-k, the candidates,
    the reference's index-key pointer (csa2.attention41)."""
    sources = {layer: st.source for layer, st in enumerate(state.layers) if st.source is not None}
    last_source = max(sources) if sources else None
    return {"sources": sources, "topk": None, "candidates": None, "candidate_ids": None,
            "index_keys": sources[last_source].index_keys if sources else None}


def run_layers41(params: Model41, cfg: ModelConfig, h, pre_mix, token_ids, state: State41, start, n_valid, layers,
                 shared: dict, *, image_mask=None, row_ids=None, teacher=None):
    """Blocks `layers` (ascending) on the stream (h, pre_mix) at positions start[b]+t. Returns (h, pre_mix, the
    state of every layer — the others unchanged —, each run block's output, the DSpark taps met)."""
    live = None if image_mask is None else ~image_mask
    new_layers, outputs, taps = list(state.layers), [], []
    for layer in layers:
        w, st = params.layers[layer], state.layers[layer]
        with jax.named_scope(f"layer{layer}"):
            if teacher is not None:
                h_in, pre_in, use = teacher
                h = jnp.where(use[layer], h_in[layer].astype(h.dtype), h)
                pre_mix = jnp.where(use[layer], pre_in[layer].astype(jnp.float32), pre_mix)
            if w.engram is not None:
                k = cfg.engram_layer_ids.index(layer)
                rows = engram_rows(w.engram.embed, row_ids[:, :, k], cfg)   # a lookup, exact: outside per_token
                if live is None:
                    h = per_token(cfg, lambda h, r: engram(h, r, w.engram, cfg), h, rows)
                else:
                    h = per_token(cfg, lambda h, r, lv: engram(h, r, w.engram, cfg, lv), h, rows, live)
            if layer in cfg.dspark_target_layer_ids:
                taps.append(per_token(cfg, stream_mean, h))
            h, pre_mix, st = block41(h, pre_mix, token_ids, w, cfg, layer, st, shared, start, n_valid,
                                     image_mask=image_mask)
        new_layers[layer] = st
        outputs.append((h, pre_mix))
    return h, pre_mix, new_layers, outputs, taps


def forward_hidden41(params: Model41, cfg: ModelConfig, token_ids, state: State41, n_valid=None, *,
                     teacher=None, collect=False, record: dict | None = None, image=None):
    """token_ids [B,T] at positions state.lengths[b]+t -> (final collapsed stream y [B,T,D], new state).

    `image` = (span_rows [R,D], index int32 [B,T]), index -1 at text positions: image-span positions take their
    rows as embeddings, route with the MoE's VL bias, get Engram gate 0 and end every n-gram (official model.py,
    Transformer.forward with token_types).

    `teacher` = (h_in [L,B,T,n,D], pre_in [L,B,T,n], use bool [L]) replaces block l's input (h, pre_mix) by
    (h_in[l], pre_in[l]) where use[l] (teacher forcing from saved block outputs; traced, so one compile serves
    every choice); `collect` also returns every block's (h, pre_mix) output, stacked. `record` (a dict) receives
    "pending" (each layer's inputs for `commit_chunk41`) and "taps" [B,T,len(targets)*D]: the stream mean at the
    input of each DSpark target layer (after its Engram), the draft's conditioning."""
    B, T = token_ids.shape
    n_valid = jnp.full((B,), T, jnp.int32) if n_valid is None else n_valid.astype(jnp.int32)
    start = state.lengths
    image_mask = None if image is None else image[1] >= 0
    row_ids = hash_ids(cfg, state.engram_history, token_ids, image_mask) if cfg.engram_layer_ids else None
    h, pre_mix = embed41(params, cfg, token_ids, image)
    shared = new_shared(state)
    h, pre_mix, layers, outputs, taps = run_layers41(
        params, cfg, h, pre_mix, token_ids, state, start, n_valid, range(cfg.n_layers), shared,
        image_mask=image_mask, row_ids=row_ids, teacher=teacher)
    history = next_history(state.engram_history, token_ids, n_valid, image_mask)
    new = State41(lengths=start + n_valid, layers=tuple(layers), engram_history=history)
    y = per_token(cfg, collapse, h, pre_mix)
    if record is not None:
        record["pending"] = tuple(shared["pending"])
        record["taps"] = jnp.concatenate(taps, axis=-1) if taps else None
    if collect:
        return y, new, (jnp.stack([o[0] for o in outputs]), jnp.stack([o[1] for o in outputs]))
    return y, new


def head_logits41(y, params: Model41, cfg: ModelConfig, norm_w=None):
    """RMSNorm (the model's, or `norm_w`: the last DSpark stage's) -> fp32 head (the reference keeps the head
    weight in fp32). y [b,s,D] -> [b,s,V] float32."""
    def head(y):
        y = rms_norm(y, params.norm if norm_w is None else norm_w, cfg.norm_eps)
        return lm_head(y, params.head)

    return per_token(cfg, head, y)


def commit_chunk41(params: Model41, cfg: ModelConfig, state: State41, pendings, token_ids, n_valid) -> State41:
    """The state after only the first n_valid[b] tokens of a chunk run on `state` (`record["pending"]` of that
    forward): every layer's window and source via `commit_layer41`, and the Engram token history."""
    start = state.lengths
    layers = tuple(commit_layer41(x, kv, w.attn, cfg, layer, st, start, n_valid)
                   for layer, (w, st, (x, kv)) in enumerate(zip(params.layers, state.layers, pendings)))
    history = next_history(state.engram_history, token_ids, n_valid)
    return State41(lengths=start + n_valid, layers=layers, engram_history=history)


def forward_chunk41(params: Model41, cfg: ModelConfig, token_ids, state: State41, n_valid=None):
    """Logits float32 [B,T,V] of one chunk, and the advanced state."""
    y, state = forward_hidden41(params, cfg, token_ids, state, n_valid)
    return head_logits41(y, params, cfg), state


def forward41(params: Model41, cfg: ModelConfig, token_ids, positions=None, max_seq: int | None = None, image=None):
    """Full-sequence logits float32 [b, s, V] (or [b, len(positions), V]); caches sized for `max_seq` tokens."""
    b, s = token_ids.shape
    y, _ = forward_hidden41(params, cfg, token_ids, init_state41(cfg, b, max(s, max_seq or s)), image=image)
    if positions is not None:
        y = y[:, jnp.asarray(positions)]
    return head_logits41(y, params, cfg)
