"""V4.1's DSpark draft (spec §3.11): three stages that draft a block of `dspark_block_size` tokens in one pass.

The target's taps (the stream means at the inputs of `dspark_target_layer_ids`) at position p give
main_x[p] = main_norm(main_proj(taps[p])). Each stage keeps a window ring of its own KV of main_x — written for
every committed position, prefill included — and nothing else. To draft after the target has produced token t at
position P+1 (its newest committed position is P): the block [t, noise, ...] at positions P+1..P+S runs through
the stages (V4.1 blocks with staggered mHC whose attention lets every block query see all valid ring slots and all
S block positions — non-causal, the block KV is not cached); the last stage's collapsed stream gives logits with
the shared head, a low-rank Markov bias from the previous block token (sequential: each draft conditions the next
bias) and a confidence per position from [stream; Markov embedding].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsjax import v41_rows
from dsjax.config import ModelConfig
from dsjax.layers.attention import attend_keys, update_ring
from dsjax.layers.csa2 import project_kv, project_q
from dsjax.layers.linear import linear
from dsjax.layers.lm_head import lm_head
from dsjax.layers.norms import rms_norm
from dsjax.layers.rope import rope_angles
from dsjax.layers.rows import per_token
from dsjax.sharding import gather_vocab
from dsjax.v41_model import block41, collapse, embed41, head_logits41
from dsjax.v41_weights import Attention41, DSparkStage, Model41


def stage_layer(cfg: ModelConfig, stage: int) -> int:
    return cfg.n_layers + stage


def stage_cfg(cfg: ModelConfig) -> ModelConfig:
    """The stages' MoE routes to `dspark_n_activated_experts` of their own experts."""
    return cfg.replace(n_activated_experts=cfg.dspark_n_activated_experts or cfg.n_activated_experts)


def init_rings(cfg: ModelConfig, batch: int) -> tuple:
    """One window ring per stage, in the backbone windows' row format: slot s holds the latest p ≡ s (mod W)."""
    from dsjax.v41_rows import row_shapes

    d, dt = row_shapes(cfg)["window"]
    return tuple(jnp.zeros((batch, cfg.window_size, d), dt) for _ in range(cfg.n_mtp_layers))


def main_latent(params: Model41, cfg: ModelConfig, taps):
    """taps [B,T,len(targets)*D] -> main_x [B,T,D]."""
    w: DSparkStage = params.mtp[0]
    return per_token(cfg, lambda t: rms_norm(linear(t, w.main_proj, cfg), w.main_norm, cfg.norm_eps), taps)


def _main_kv(w: Attention41, cfg: ModelConfig, layer: int, main_x, positions):
    """A stage's window KV of main_x at `positions` (normed, rope, FP8 over all dims), in ring row format."""
    kv = per_token(cfg, lambda x, a: project_kv(x, w, cfg, a), main_x, rope_angles(cfg, layer, positions))
    return v41_rows.store_window(kv, cfg)


def commit_rings(params: Model41, cfg: ModelConfig, rings: tuple, main_x, start, n_valid) -> tuple:
    """Write every stage's KV of main_x [B,T,D] (positions start[b]+t, the first n_valid[b] real) into its ring."""
    pos = start[:, None] + jnp.arange(main_x.shape[1])[None, :]
    return tuple(update_ring(ring, _main_kv(w.block.attn, cfg, stage_layer(cfg, i), main_x, pos), start, n_valid)
                 for i, (w, ring) in enumerate(zip(params.mtp, rings)))


def _block_attention(P):
    """The stages' attention with attention41's signature: the block (positions P+1..P+S) attends to every ring
    slot written so far (slots < min(W, P+1), in slot order as the reference lists them) and to the whole block."""

    def attend(x, w: Attention41, cfg: ModelConfig, layer: int, ring, shared, start, n_valid):
        B, S, _ = x.shape
        W = ring.shape[1]
        angles = rope_angles(cfg, layer, P[:, None] + 1 + jnp.arange(S)[None, :])
        q, kv = per_token(cfg, lambda x, a: (project_q(x, w, cfg, a)[0], project_kv(x, w, cfg, a)), x, angles)
        keys = jnp.concatenate([v41_rows.load_window(ring, cfg).astype(kv.dtype), kv], axis=1)     # [B,W+S,d]
        valid = jnp.concatenate([jnp.arange(W)[None, :] < jnp.minimum(W, P + 1)[:, None],
                                 jnp.ones((B, S), bool)], axis=1)
        keys = jnp.broadcast_to(keys[:, None], (B, S) + keys.shape[1:])
        valid = jnp.broadcast_to(valid[:, None], (B, S, W + S))
        return attend_keys(q, keys, valid, angles, w, cfg), ring

    return attend


def block_streams(params: Model41, cfg: ModelConfig, rings: tuple, token, P):
    """The last stage's collapsed stream y [B,S,D] for the block [token, noise, ...] at positions P+1..P+S."""
    B, S = token.shape[0], cfg.dspark_block_size
    ids = jnp.full((B, S), cfg.dspark_noise_token_id, jnp.int32).at[:, 0].set(token)
    h, pre_mix = embed41(params, cfg, ids)
    scfg = stage_cfg(cfg)
    for i, (w, ring) in enumerate(zip(params.mtp, rings)):
        with jax.named_scope(f"dspark{i}"):
            h, pre_mix, _ = block41(h, pre_mix, ids, w.block, scfg, stage_layer(cfg, i), ring, {}, P + 1,
                                    jnp.full((B,), S, jnp.int32), attention=_block_attention(P))
    return per_token(cfg, collapse, h, pre_mix)


def markov(params: Model41, token):
    """The Markov head on the previous block token [B]: (logit bias float32 [B,V], embedding [B,rank])."""
    mh = params.mtp[-1].markov_head
    m = mh.embed[token]
    return lm_head(m, mh.head), m


def confidence(params: Model41, y, m):
    """confidence_head.proj([y; m]) in fp32: y [B,S,D] (the collapsed stream, before the norm), m [B,S,rank]."""
    proj = params.mtp[-1].confidence_head.proj
    z = jnp.concatenate([y.astype(jnp.float32), m.astype(jnp.float32)], axis=-1)
    return jnp.einsum("bsi,oi->bso", z, proj.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)[..., 0]


def draft_block(params: Model41, cfg: ModelConfig, rings: tuple, token, P, choose, n: int | None = None, y=None):
    """Draft n ≤ S = dspark_block_size tokens after `token` [B] (at position P+1; the rings hold positions ≤ P).

    `choose(i, logits_i [B,V]) -> ids [B]` picks draft i+1 (argmax, or a sample); the Markov bias of the next
    position uses it. Returns (ids int32 [B,n+1] = [token, d1..dn], logits float32 [B,n,V] with the Markov bias,
    confidence float32 [B,n]). `y`: the block's streams, when already computed (tests: many chains, one block)."""
    n = cfg.dspark_block_size if n is None else n
    y = (block_streams(params, cfg, rings, token, P) if y is None else y)[:, :n]
    logits = gather_vocab(head_logits41(y, params, cfg, params.mtp[-1].norm), cfg.sharding)
    ids, rows, embeds = [token], [], []
    for i in range(n):
        bias, m = markov(params, ids[-1])
        row = logits[:, i] + bias
        ids.append(choose(i, row).astype(jnp.int32))
        rows.append(row)
        embeds.append(m)
    return jnp.stack(ids, 1), jnp.stack(rows, 1), confidence(params, y, jnp.stack(embeds, 1))


def greedy(i, logits):
    return jnp.argmax(logits, -1)


def seed_from_chunk(params: Model41, cfg: ModelConfig, rings: tuple, taps, start, n_valid):
    """A prompt chunk's taps [B,T,.] -> (rings with its positions written, main_x [B,T,D])."""
    main_x = main_latent(params, cfg, taps)
    return commit_rings(params, cfg, rings, main_x, start, n_valid), main_x

