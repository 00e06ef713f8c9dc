"""The V4.1 weight tree: `describe41(cfg)`, one ArrayInfo per tensor of the official V4.1 checkpoint (spec §5.3).

V4.1 reuses V4's building blocks (Linear, HyperMix, MoE) and changes the attention (CSA2: a layer may own a
compressor, an indexer and index keys, or read them from its source), adds Engram on a few layers and a 3-stage
DSpark draft under `mtp.*`, and drops `hc_head`. Field names are chosen so that `checkpoint.official_name`
yields the official tensor names (`layers.2.attn.indexer.wk.weight`, `layers.1.engram.embed.scale`, ...).
"""

from __future__ import annotations

from typing import Any, Optional

import jax.numpy as jnp

from dsjax.config import ModelConfig
from dsjax.weights import (ArrayInfo, HyperMix, Linear, MoE, _attention_core, _ffn_linears, _hyper, _linear, _norm,
                           pytree)


@pytree
class Compressor41:
    wkv: Any            # bf16 [d, D] (run in fp32 when ratio > 1)
    wgate: Any          # bf16 [d, D] (ratio > 1 only, else None)
    norm: Any           # bf16 [d]


@pytree
class Indexer41:
    wq_b: Linear        # [index_heads*index_dim, q_lora]
    weights_proj: Any   # bf16 [index_heads, D]
    wk: Any             # bf16 [index_dim, d] (index-key owners only, else None)
    k_norm: Any         # bf16 [index_dim] (index-key owners only, else None)


@pytree
class Attention41:
    attn_sink: Any
    wq_a: Linear
    q_norm: Any
    wq_b: Linear
    wkv: Linear
    kv_norm: Any
    wo_a: Any           # bf16 [G*R, H*d/G] (dequantised at load, as convert.py does)
    wo_b: Linear
    compressor: Optional[Compressor41]   # KV sources only
    indexer: Optional[Indexer41]         # index sources only


@pytree
class MoE41(MoE):
    gate_bias_vl: Any = None   # f32 [E]: the routing bias of image-span tokens (checkpoints with vision)


@pytree
class EngramTable:
    weight: Any         # e4m3 [rows, head_dim]
    scale: Any          # ue8m0 bytes [rows, head_dim / 32]


@pytree
class Engram:
    embed: EngramTable
    wkv: Linear         # [(hc+1)*D, (max_ngram-1)*n_heads*head_dim]
    q_weight: Any       # bf16 [hc, D]
    k_weight: Any       # bf16 [hc, D]


@pytree
class Block41:
    attn: Attention41
    ffn: MoE41
    attn_norm: Any
    ffn_norm: Any
    hc_attn: HyperMix
    hc_ffn: HyperMix
    engram: Optional[Engram]


@pytree
class MarkovHead:
    embed: Any          # bf16 [V, rank]
    head: Any           # bf16 [V, rank]


@pytree
class ConfidenceHead:
    proj: Any           # bf16 [1, D + rank]


@pytree
class DSparkStage:
    block: Block41
    main_proj: Optional[Linear]               # stage 0: [D, len(targets)*D]
    main_norm: Any                            # stage 0
    norm: Any                                 # last stage
    markov_head: Optional[MarkovHead]         # last stage
    confidence_head: Optional[ConfidenceHead]  # last stage


@pytree
class Model41:
    embed: Any
    layers: tuple
    norm: Any
    head: Any
    mtp: tuple          # DSpark stages
    hc_head: Any = None  # V4.1 has no hc_head (the last block's FFN pre_mix collapses the streams)
    # vision (cfg.vision_enabled): the ViT, the aligner and the image-span vectors (dsjax.vision.weights)
    vision: Any = None
    aligner: Any = None
    image_start: Any = None
    image_end: Any = None
    image_newline: Any = None


# ---------------------------------------------------------------------- the V4.1 schedule (spec §2.2)
def kv_source_of(cfg: ModelConfig, layer: int) -> int:
    """The KV-source layer whose compressed cache `layer` reads: the latest source at or before it."""
    src = [s for s in cfg.kv_source_layers if s <= layer]
    return src[-1] if src else -1


def index_source_of(cfg: ModelConfig, layer: int) -> int:
    """The index source whose top-k `layer` uses: the latest index source at or before it."""
    src = [s for s in cfg.index_source_layers if s <= layer]
    return src[-1] if src else -1


def is_backbone(cfg: ModelConfig, layer: int) -> bool:
    return layer < cfg.n_layers


def owns_compressor(cfg: ModelConfig, layer: int) -> bool:
    return is_backbone(cfg, layer) and layer in cfg.kv_source_layers


def owns_indexer(cfg: ModelConfig, layer: int) -> bool:
    return is_backbone(cfg, layer) and layer in cfg.index_source_layers


def engram_columns(cfg: ModelConfig) -> int:
    return (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads


# ---------------------------------------------------------------------- the description
def _attention41(cfg: ModelConfig, layer: int) -> Attention41:
    d, D = cfg.head_dim, cfg.dim
    ratio = cfg.layer_ratio(layer)
    std = (1.0 / D) ** 0.5
    compressor = indexer = None
    if owns_compressor(cfg, layer):
        compressor = Compressor41(
            wkv=ArrayInfo((d, D), jnp.bfloat16, (None, None), ("normal", std)),
            wgate=ArrayInfo((d, D), jnp.bfloat16, (None, None), ("normal", std)) if ratio > 1 else None,
            norm=_norm(d))
    if owns_indexer(cfg, layer):
        owner = owns_compressor(cfg, layer)
        indexer = Indexer41(
            wq_b=_linear(cfg, cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank, ("index_heads", None)),
            weights_proj=ArrayInfo((cfg.index_n_heads, D), jnp.bfloat16, ("index_heads", None), ("normal", std)),
            wk=ArrayInfo((cfg.index_head_dim, d), jnp.bfloat16, (None, None), ("normal", (1.0 / d) ** 0.5)) if owner else None,
            k_norm=_norm(cfg.index_head_dim) if owner else None)
    return Attention41(**_attention_core(cfg), compressor=compressor, indexer=indexer)


def _moe41(cfg: ModelConfig, layer: int) -> MoE41:
    E = cfg.n_routed_experts if is_backbone(cfg, layer) else (cfg.dspark_n_routed_experts or cfg.n_routed_experts)
    D = cfg.dim
    bias = ArrayInfo((E,), jnp.float32, (None,), ("normal", 0.5))
    return MoE41(
        gate=ArrayInfo((E, D), jnp.bfloat16, (None, None), ("normal", (16.0 / D) ** 0.5)),
        gate_bias=bias,
        tid2eid=None,
        **_ffn_linears(cfg, E),
        gate_bias_vl=bias if cfg.vision_enabled else None,
    )


def _engram(cfg: ModelConfig, layer: int) -> Engram:
    k = cfg.engram_layer_ids.index(layer)
    rows, hd, D, n = cfg.engram_num_embeddings[k], cfg.engram_head_dim, cfg.dim, cfg.hc_mult
    return Engram(
        embed=EngramTable(weight=ArrayInfo((rows, hd), jnp.float8_e4m3fn, ("engram_rows", None), ("normal", 1.0)),
                          scale=ArrayInfo((rows, hd // 32), jnp.uint8, ("engram_rows", None),
                                          ("uniform", 127.0, 127.0))),  # e8m0 byte 127 = 1
        wkv=_linear(cfg, (n + 1) * D, engram_columns(cfg) * hd, (None, None)),
        q_weight=ArrayInfo((n, D), jnp.bfloat16, (None, None), ("uniform", 0.5, 1.5)),
        k_weight=ArrayInfo((n, D), jnp.bfloat16, (None, None), ("uniform", 0.5, 1.5)),
    )


def _block41(cfg: ModelConfig, layer: int) -> Block41:
    rows = (2 + cfg.hc_mult) * cfg.hc_mult
    return Block41(attn=_attention41(cfg, layer), ffn=_moe41(cfg, layer), attn_norm=_norm(cfg.dim),
                   ffn_norm=_norm(cfg.dim), hc_attn=_hyper(cfg, rows), hc_ffn=_hyper(cfg, rows),
                   engram=_engram(cfg, layer) if layer in cfg.engram_layer_ids else None)


def _dspark_stage(cfg: ModelConfig, stage: int) -> DSparkStage:
    D, V, r = cfg.dim, cfg.vocab_size, cfg.dspark_markov_rank
    first, last = stage == 0, stage == cfg.n_mtp_layers - 1
    return DSparkStage(
        block=_block41(cfg, cfg.n_layers + stage),
        main_proj=_linear(cfg, D, len(cfg.dspark_target_layer_ids) * D, (None, None)) if first else None,
        main_norm=_norm(D) if first else None,
        norm=_norm(D) if last else None,
        markov_head=MarkovHead(embed=ArrayInfo((V, r), jnp.bfloat16, (None, None), ("normal", 1.0)),
                               head=ArrayInfo((V, r), jnp.bfloat16, (None, None), ("normal", (1.0 / r) ** 0.5)))
        if last else None,
        confidence_head=ConfidenceHead(proj=ArrayInfo((1, D + r), jnp.bfloat16, (None, None),
                                                      ("normal", (1.0 / (D + r)) ** 0.5))) if last else None,
    )


def describe41(cfg: ModelConfig) -> Model41:
    """The ArrayInfo tree of every weight of a V4.1 model (the vision tower when `cfg.vision_enabled`)."""
    from dsjax.vision.weights import describe_vision

    D, V = cfg.dim, cfg.vocab_size
    return Model41(
        embed=ArrayInfo((V, D), jnp.bfloat16, ("vocab", None), ("normal", 1.0)),
        layers=tuple(_block41(cfg, i) for i in range(cfg.n_layers)),
        norm=_norm(D),
        head=ArrayInfo((V, D), jnp.bfloat16, ("vocab", None), ("normal", (4.0 / D) ** 0.5)),
        mtp=tuple(_dspark_stage(cfg, i) for i in range(cfg.n_mtp_layers if cfg.dspark_block_size else 0)),
        **(describe_vision(cfg) if cfg.vision_enabled else {}),
    )
