"""The V4.1 vision weights: ViT, aligner and the span vectors, one ArrayInfo each (spec §5.3: 266 BF16 tensors).

Field names give the official tensor names through `checkpoint.official_name`: `vision.patch_embed.proj.weight`,
`vision.blocks.N.{norm1,norm2}.weight`, `vision.blocks.N.attn.{wqkv,wo}.{weight,bias}`,
`vision.blocks.N.mlp.{w1,w2}.weight`, `vision.norm.weight`, `aligner.{w1,w2}.{weight,bias}`, `image_start`,
`image_end`, `image_newline`. Every tensor is replicated (0.49B parameters at the release's sizes).
"""

from __future__ import annotations

from typing import Any, Optional

import jax.numpy as jnp

from dsjax.config import ModelConfig
from dsjax.weights import ArrayInfo, pytree


@pytree
class Dense:
    weight: Any             # bf16 [out, in]
    bias: Optional[Any]     # bf16 [out] or None


@pytree
class PatchEmbed:
    proj: Dense             # [vision_dim, 3·p·p]


@pytree
class VisionAttention:
    wqkv: Dense             # [3·vision_dim, vision_dim] with bias: q | k | v
    wo: Dense               # [vision_dim, vision_dim] with bias


@pytree
class VisionMLP:
    w1: Dense               # [2·inter, vision_dim], no bias: gate | up
    w2: Dense               # [vision_dim, inter], no bias


@pytree
class VisionBlock:
    norm1: Any
    attn: VisionAttention
    norm2: Any
    mlp: VisionMLP


@pytree
class ViT:
    patch_embed: PatchEmbed
    blocks: tuple
    norm: Any


@pytree
class Aligner:
    w1: Dense               # [D, vision_dim·downsample²] with bias
    w2: Dense               # [D, D] with bias


def _dense(out: int, inp: int, bias: bool, gain: float = 1.0) -> Dense:
    std = (gain / inp) ** 0.5
    return Dense(weight=ArrayInfo((out, inp), jnp.bfloat16, (None, None), ("normal", std)),
                 bias=ArrayInfo((out,), jnp.bfloat16, (None,), ("normal", 0.02)) if bias else None)


def _norm(n: int) -> ArrayInfo:
    return ArrayInfo((n,), jnp.bfloat16, (None,), ("uniform", 0.8, 1.2))


def describe_vision(cfg: ModelConfig) -> dict[str, Any]:
    """The vision fields of `Model41` (vision, aligner, image_start, image_end, image_newline)."""
    W, I, D, p, r = cfg.vision_dim, cfg.vision_inter_dim, cfg.dim, cfg.vision_patch_size, cfg.vision_downsample_ratio
    block = VisionBlock(norm1=_norm(W), attn=VisionAttention(wqkv=_dense(3 * W, W, True), wo=_dense(W, W, True)),
                        norm2=_norm(W), mlp=VisionMLP(w1=_dense(2 * I, W, False), w2=_dense(W, I, False)))
    span = ArrayInfo((D,), jnp.bfloat16, (None,), ("normal", 1.0))
    return dict(
        vision=ViT(patch_embed=PatchEmbed(proj=_dense(W, 3 * p * p, True)),
                   blocks=tuple(block for _ in range(cfg.vision_n_layers)), norm=_norm(W)),
        aligner=Aligner(w1=_dense(D, W * r * r, True, gain=2.0), w2=_dense(D, D, True)),
        image_start=span, image_end=span, image_newline=span)
