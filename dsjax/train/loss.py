"""Training numerics and the joint loss: next-token cross-entropy plus the MTP head's token-after-next.

Why train in a bf16-format config with fp32 master weights: the inference formats (FP8 e4m3 + ue8m0 blocks,
packed FP4 experts) are integer codes with no gradient, and the reference presets' fake quantisation (KV FP8
rounding, FP4 index keys) rounds through bit tricks. So training runs the *same* forward (dsjax.model, the
`xla` kernels) on a copy of the architecture whose linears are plain 'bf16'-format Linear nodes holding fp32
arrays, with fp32 (or bf16) activations and every quant sim off (`train_config`). `jax.grad` goes through that forward
unchanged. The export (export.py) rounds the trained weights to the official formats and measures the loss
again through `dsjax.load`, so the shipped figure is the quantised model's own.

What gets no gradient, by construction: the indexer (its scores only pick which compressed entries attend:
top-k is piecewise constant; V3.2/V4 train it by distillation, not done here) and the top-k gate's bias (it
steers selection only; DeepSeek updates it by load balancing, not by gradient). Integer leaves (hash routing's
tid2eid, the vocabulary map) are frozen and kept apart from the optimizer (`split`).

MTP (mtp.py): at position t the head reads the main model's streams before hc_head and the embedding of token
t+1, and predicts token t+2. Loss = CE(next token) + mtp_weight * CE(token after next), both over the head's
rows (targets mapped with the reduced vocabulary; unmapped targets are the reserved row's class).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsjax.config import ModelConfig
from dsjax.model import forward_hidden_chunk, head_rows, token_rows
from dsjax.mtp import mtp_hidden
from dsjax.state import init_state


def train_config(cfg: ModelConfig, compute_dtype: str = "float32") -> ModelConfig:
    """The differentiable twin of `cfg`: bf16-format linears (held in fp32), no fake quant; activations in
    `compute_dtype` (bfloat16: the tensor cores and the activation dtype the checkpoint is served with; the
    weights are cast per matmul, gradients reach the fp32 masters). kernels="reference": XLA everywhere, and the
    routed experts dense (every expert on every token, masked by its routing weight) — with 8 experts that is 4x the
    routed FLOPs in plain matmuls, where the sorted `ragged_dot`'s gradient materialises [E, rows, d] masks."""
    return cfg.replace(weight_dtype="bf16", expert_dtype="bf16", compute_dtype=compute_dtype, kv_quant_sim=False,
                       index_quant_sim=False, act_quant_sim=False, batch_invariant=False, kernels="reference")


def _is_float(x) -> bool:
    return x is not None and jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)


def split(params):
    """(trainable fp32 leaves, frozen integer leaves): two trees of the same structure, None where the other holds."""
    train = jax.tree.map(lambda a: jnp.array(a, jnp.float32) if _is_float(a) else None, params)  # a copy: steps donate it
    frozen = jax.tree.map(lambda a: None if _is_float(a) else a, params)
    return train, frozen


def with_vocab(params, vocab_ids):
    """`params` with its vocabulary map replaced (init draws the first ids in order)."""
    import dataclasses

    return dataclasses.replace(params, vocab_ids=jnp.asarray(vocab_ids, jnp.int32))


def zero_gate_bias(params):
    """Top-k gates' selection bias set to 0: it gets no gradient (selection only) and we run no load-balancing
    update, so a random init would be a fixed random preference for some experts."""
    import dataclasses

    layers = tuple(dataclasses.replace(b, ffn=dataclasses.replace(b.ffn, gate_bias=jnp.zeros_like(b.ffn.gate_bias)))
                   if b.ffn.gate_bias is not None else b for b in params.layers)
    mtp = tuple(dataclasses.replace(m, block=dataclasses.replace(m.block, ffn=dataclasses.replace(
        m.block.ffn, gate_bias=jnp.zeros_like(m.block.ffn.gate_bias)))) if m.block.ffn.gate_bias is not None else m
        for m in params.mtp)
    return dataclasses.replace(params, layers=layers, mtp=mtp)


def merge(train, frozen):
    return jax.tree.map(lambda a, b: b if a is None else a, train, frozen, is_leaf=lambda x: x is None)


def cross_entropy(logits, targets, mask):
    """Mean over `mask` of −log softmax(logits)[target]. logits [b,s,R] f32, targets/mask [b,s]."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def losses(params, cfg: ModelConfig, token_ids):
    """(main CE, MTP CE) of a batch token_ids int32 [b, s] (s ≥ 3), both in nats per token."""
    b, s = token_ids.shape
    state = init_state(cfg, b, s, with_mtp=bool(cfg.n_mtp_layers))
    h, _ = forward_hidden_chunk(params, cfg, token_ids, state)
    rows = token_rows(params, cfg, token_ids)
    pos = jnp.arange(s)
    main = cross_entropy(head_rows(h, params, cfg, params.hc_head, params.norm, "fp32")[:, :-1], rows[:, 1:],
                         jnp.ones((b, s - 1), jnp.float32))
    if not cfg.n_mtp_layers:
        return main, jnp.zeros((), jnp.float32)
    # MTP at every position t < s-1: streams h_t and token t+1 -> token t+2 (targets exist for t < s-2)
    nxt = jnp.concatenate([token_ids[:, 1:], token_ids[:, -1:]], axis=1)
    z, _ = mtp_hidden(params, cfg, h, nxt, state.mtp[0],
                      jnp.zeros((b,), jnp.int32), jnp.full((b,), s, jnp.int32))
    w = params.mtp[0]
    mtp_logits = head_rows(z, params, cfg, w.hc_head, w.norm, "fp32")
    tgt = jnp.concatenate([rows[:, 2:], rows[:, :2]], axis=1)
    mask = jnp.broadcast_to((pos < s - 2).astype(jnp.float32), (b, s))
    return main, cross_entropy(mtp_logits, tgt, mask)


def total_loss(train, frozen, cfg: ModelConfig, token_ids, mtp_weight: float):
    main, mtp = losses(merge(train, frozen), cfg, token_ids)
    return main + mtp_weight * mtp, (main, mtp)
