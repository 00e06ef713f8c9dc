"""Weight pytrees, and `describe(cfg)`: the one description of every array of a V4 model.

Weights stay in their checkpoint formats on the device: FP8 e4m3 with ue8m0 block scales (stored as raw uint8
exponent bytes), packed FP4 e2m1 (two codes per uint8, low nibble first) with per-32 ue8m0 scales, bf16 and
fp32 as stored. Everything else — random init, abstract shapes for planning, shardings, checkpoint names — is
derived from the `ArrayInfo` tree `describe` returns.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from dsjax.config import ModelConfig


def pytree(cls=None, *, meta: tuple[str, ...] = ()):
    """Frozen dataclass registered as a pytree; `meta` fields are static (hashed, not traced)."""

    def wrap(c):
        c = dataclasses.dataclass(frozen=True)(c)
        names = [f.name for f in dataclasses.fields(c)]
        return jax.tree_util.register_dataclass(
            c, data_fields=[n for n in names if n not in meta], meta_fields=list(meta))

    return wrap if cls is None else wrap(cls)


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
    """Shape, stored dtype and logical axes of one array; `init` names its random distribution."""

    shape: tuple[int, ...]
    dtype: Any
    axes: tuple[Optional[str], ...]
    init: tuple = ("normal", 0.02)  # ("normal", std) | ("uniform", lo, hi) | ("zeros",) | ("tid2eid",) | ("vocab_ids",)
    logical_shape: tuple[int, ...] | None = None  # unpacked [.., out, in] for quantised weights


@pytree(meta=("fmt", "block"))
class Linear:
    """A [.., out, in] linear weight in its stored format: fmt 'bf16' | 'f32' | 'fp8' (e4m3 + [out/B, in/B]
    ue8m0 scales) | 'fp4' (uint8 [out, in/2] + [out, in/32] ue8m0 scales). Leading dims stack experts."""

    weight: Any
    scale: Any
    fmt: str
    block: int


def stored_linear(w, fmt: str, block: int) -> Linear:
    """Float weights [.., out, in] as a Linear in `fmt`: 'fp8' (block x block scales), 'fp4' (per-`block` scales
    along in) or 'bf16' — the checkpoint's formats, for random test and benchmark weights."""
    from dsjax import quant

    if fmt == "fp8":
        return Linear(*quant.quantize_fp8_blocks(jnp.asarray(w, jnp.float32), (block, block)), "fp8", block)
    if fmt == "fp4":
        return Linear(*quant.quantize_fp4_packed(jnp.asarray(w, jnp.float32), block), "fp4", block)
    if fmt == "bf16":
        return Linear(jnp.asarray(w, jnp.bfloat16), None, "bf16", block)
    raise ValueError(f"stored_linear: fmt must be fp8, fp4 or bf16, got {fmt!r}")


@pytree
class Compressor:
    ape: Any          # f32 [ratio, c*d]
    wkv: Any          # bf16 [c*d, D]
    wgate: Any        # bf16 [c*d, D]
    norm: Any         # bf16 [d]


@pytree
class Indexer:
    wq_b: Linear      # [index_heads*index_dim, q_lora]
    weights_proj: Any  # bf16 [index_heads, D]
    compressor: Compressor


@pytree
class Attention:
    attn_sink: Any    # f32 [H]
    wq_a: Linear
    q_norm: Any
    wq_b: Linear
    wkv: Linear
    kv_norm: Any
    wo_a: Any         # bf16 [G*R, H*d/G] (dequantised at load, as the official convert.py does)
    wo_b: Linear
    compressor: Optional[Compressor]
    indexer: Optional[Indexer]


@pytree
class MoE:
    gate: Any         # bf16 [E, D]
    gate_bias: Any    # f32 [E] (score-routed layers) or None
    tid2eid: Any      # int32 [V, k] (hash-routed layers) or None
    w1: Linear        # stacked [E, inter, D]
    w2: Linear        # stacked [E, D, inter]
    w3: Linear
    shared_w1: Linear
    shared_w2: Linear
    shared_w3: Linear


@pytree
class HyperMix:
    fn: Any           # f32 [(2+n)*n, n*D]
    base: Any         # f32 [(2+n)*n]
    scale: Any        # f32 [3]


@pytree
class Block:
    attn: Attention
    ffn: MoE
    attn_norm: Any
    ffn_norm: Any
    hc_attn: HyperMix
    hc_ffn: HyperMix


@pytree
class HcHead:
    fn: Any           # f32 [n, n*D]
    base: Any         # f32 [n]
    scale: Any        # f32 [1]


@pytree
class MTP:
    block: Block
    e_proj: Linear
    h_proj: Linear
    enorm: Any
    hnorm: Any
    norm: Any
    hc_head: HcHead


@pytree
class Model:
    embed: Any        # bf16 [V, D]
    layers: tuple
    norm: Any
    head: Any         # bf16 [V, D]
    hc_head: HcHead
    mtp: tuple
    vocab_ids: Any = None  # int32 [head_vocab_size]: token id of each embed/head row (reduced vocabulary only)


# ---------------------------------------------------------------------- the description
def _norm(d, axes=(None,)):
    return ArrayInfo((d,), jnp.bfloat16, axes, ("uniform", 0.8, 1.2))


def _linear(cfg: ModelConfig, out: int, inp: int, axes, *, fmt: str | None = None, lead: tuple[int, ...] = (),
            lead_axes: tuple = (), std: float | None = None) -> Linear:
    fmt = fmt or ("fp8" if cfg.weight_dtype == "fp8" else "bf16")
    std = std if std is not None else (1.0 / inp) ** 0.5
    init = ("normal", std)
    logical = lead + (out, inp)
    if fmt == "fp8":
        b = cfg.weight_block_size
        w = ArrayInfo(logical, jnp.float8_e4m3fn, lead_axes + axes, init, logical)
        s = ArrayInfo(lead + (-(-out // b), -(-inp // b)), jnp.uint8, lead_axes + axes, ("zeros",))
        return Linear(w, s, "fp8", b)
    if fmt == "fp4":
        w = ArrayInfo(lead + (out, inp // 2), jnp.uint8, lead_axes + axes, init, logical)
        s = ArrayInfo(lead + (out, inp // 32), jnp.uint8, lead_axes + axes, ("zeros",))
        return Linear(w, s, "fp4", 32)
    return Linear(ArrayInfo(logical, jnp.bfloat16, lead_axes + axes, init, logical), None, "bf16", 0)


def _hyper(cfg: ModelConfig, rows: int) -> HyperMix:
    n, D = cfg.hc_mult, cfg.dim
    return HyperMix(
        fn=ArrayInfo((rows, n * D), jnp.float32, (None, None), ("normal", (1.0 / (n * D)) ** 0.5)),
        base=ArrayInfo((rows,), jnp.float32, (None,), ("normal", 0.5)),
        scale=ArrayInfo((3,), jnp.float32, (None,), ("uniform", 0.5, 1.5)),
    )


def _compressor(cfg: ModelConfig, ratio: int, d: int) -> Compressor:
    c = 2 if ratio == 4 else 1
    D = cfg.dim
    return Compressor(
        ape=ArrayInfo((ratio, c * d), jnp.float32, (None, None), ("normal", 0.5)),
        wkv=ArrayInfo((c * d, D), jnp.bfloat16, (None, None), ("normal", (1.0 / D) ** 0.5)),
        wgate=ArrayInfo((c * d, D), jnp.bfloat16, (None, None), ("normal", (1.0 / D) ** 0.5)),
        norm=_norm(d),
    )


def _attention(cfg: ModelConfig, layer: int) -> Attention:
    d, D = cfg.head_dim, cfg.dim
    ratio = cfg.layer_ratio(layer)
    kind = cfg.layer_kind(layer)
    compressor = _compressor(cfg, ratio, d) if ratio else None
    indexer = None
    if kind == "csa":
        indexer = Indexer(
            wq_b=_linear(cfg, cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank, ("index_heads", None)),
            weights_proj=ArrayInfo((cfg.index_n_heads, D), jnp.bfloat16, ("index_heads", None), ("normal", (1.0 / D) ** 0.5)),
            compressor=_compressor(cfg, ratio, cfg.index_head_dim),
        )
    return Attention(**_attention_core(cfg), compressor=compressor, indexer=indexer)


def _attention_core(cfg: ModelConfig) -> dict:
    """The attention leaves V4 and V4.1 share: sink, low-rank q, the KV latent projection, grouped low-rank output."""
    H, d, D, G, R = cfg.n_heads, cfg.head_dim, cfg.dim, cfg.o_groups, cfg.o_lora_rank
    return dict(
        attn_sink=ArrayInfo((H,), jnp.float32, ("heads",), ("normal", 1.0)),
        wq_a=_linear(cfg, cfg.q_lora_rank, D, (None, None)),
        q_norm=_norm(cfg.q_lora_rank),
        wq_b=_linear(cfg, H * d, cfg.q_lora_rank, ("heads", None)),
        wkv=_linear(cfg, d, D, (None, None)),
        kv_norm=_norm(d),
        wo_a=ArrayInfo((G * R, H * d // G), jnp.bfloat16, ("heads", None), ("normal", (G / (H * d)) ** 0.5)),
        wo_b=_linear(cfg, D, G * R, (None, "heads")),
    )


def _ffn_linears(cfg: ModelConfig, E: int) -> dict:
    """The MoE's E routed experts (stacked, in the config's expert format) and its shared expert: one layout and
    one initialisation for V4 and V4.1."""
    D, I = cfg.dim, cfg.moe_inter_dim
    efmt = {"fp4": "fp4", "fp8": "fp8", "bf16": "bf16"}[cfg.expert_dtype]
    ex = dict(lead=(E,), lead_axes=("experts",), fmt=efmt)
    return dict(
        w1=_linear(cfg, I, D, ("moe_ffn", None), std=(2.25 / D) ** 0.5, **ex),
        w2=_linear(cfg, D, I, (None, "moe_ffn"), std=(0.01 / I) ** 0.5, **ex),
        w3=_linear(cfg, I, D, ("moe_ffn", None), std=(2.25 / D) ** 0.5, **ex),
        shared_w1=_linear(cfg, I, D, ("ffn", None), std=(4.0 / D) ** 0.5),
        shared_w2=_linear(cfg, D, I, (None, "ffn"), std=(0.01 / I) ** 0.5),
        shared_w3=_linear(cfg, I, D, ("ffn", None), std=(4.0 / D) ** 0.5),
    )


def _moe(cfg: ModelConfig, layer: int) -> MoE:
    E, D, k = cfg.n_routed_experts, cfg.dim, cfg.n_activated_experts
    hashed = cfg.layer_uses_hash_routing(layer)
    return MoE(
        gate=ArrayInfo((E, D), jnp.bfloat16, (None, None), ("normal", (16.0 / D) ** 0.5)),
        gate_bias=None if hashed else ArrayInfo((E,), jnp.float32, (None,), ("normal", 0.5)),
        tid2eid=ArrayInfo((cfg.head_vocab_size or cfg.vocab_size, k), jnp.int32, (None, None), ("tid2eid",)) if hashed else None,
        **_ffn_linears(cfg, E),
    )


def _block(cfg: ModelConfig, layer: int) -> Block:
    rows = (2 + cfg.hc_mult) * cfg.hc_mult
    return Block(attn=_attention(cfg, layer), ffn=_moe(cfg, layer), attn_norm=_norm(cfg.dim),
                 ffn_norm=_norm(cfg.dim), hc_attn=_hyper(cfg, rows), hc_ffn=_hyper(cfg, rows))


def _hc_head(cfg: ModelConfig) -> HcHead:
    n, D = cfg.hc_mult, cfg.dim
    return HcHead(fn=ArrayInfo((n, n * D), jnp.float32, (None, None), ("normal", (1.0 / (n * D)) ** 0.5)),
                  base=ArrayInfo((n,), jnp.float32, (None,), ("normal", 0.5)),
                  scale=ArrayInfo((1,), jnp.float32, (None,), ("uniform", 0.5, 1.5)))


def describe(cfg: ModelConfig) -> Model:
    """The ArrayInfo tree of every weight of `cfg` (V4.1: `v41_weights.describe41`)."""
    if cfg.family == "v4.1":
        from dsjax.v41_weights import describe41
        return describe41(cfg)
    D, V = cfg.dim, cfg.head_vocab_size or cfg.vocab_size
    mtp = tuple(
        MTP(block=_block(cfg, cfg.n_layers + i), e_proj=_linear(cfg, D, D, (None, None)),
            h_proj=_linear(cfg, D, D, (None, None)), enorm=_norm(D), hnorm=_norm(D), norm=_norm(D),
            hc_head=_hc_head(cfg))
        for i in range(cfg.n_mtp_layers))
    return Model(
        embed=ArrayInfo((V, D), jnp.bfloat16, ("vocab", None), ("normal", 1.0)),
        layers=tuple(_block(cfg, i) for i in range(cfg.n_layers)),
        norm=_norm(D),
        head=ArrayInfo((V, D), jnp.bfloat16, ("vocab", None), ("normal", (4.0 / D) ** 0.5)),
        hc_head=_hc_head(cfg),
        mtp=mtp,
        vocab_ids=ArrayInfo((V,), jnp.int32, (None,), ("vocab_ids",)) if cfg.head_vocab_size else None,
    )


def is_info(x) -> bool:
    return isinstance(x, ArrayInfo)


def abstract(cfg: ModelConfig) -> Model:
    """jax.ShapeDtypeStruct tree: for planning memory and for restoring checkpoints without allocating."""
    return jax.tree.map(lambda i: jax.ShapeDtypeStruct(i.shape, i.dtype), describe(cfg), is_leaf=is_info)


def nbytes(cfg: ModelConfig) -> int:
    leaves = jax.tree.leaves(describe(cfg), is_leaf=is_info)
    return int(sum(np.prod(i.shape) * np.dtype(i.dtype).itemsize for i in leaves))
