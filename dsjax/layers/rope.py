"""Interleaved partial RoPE on the trailing `rope_head_dim` dims, with the reference's fp32 tables.

Pairs (2k, 2k+1) of the rope dims are complex numbers multiplied by e^{i·pos·ω_k}; the inverse rotation
(output de-rotation) uses the conjugate. Angles are float32(pos) · ω_k in float32, as torch.outer does.
"""

import jax
import jax.numpy as jnp

from dsjax.config import ModelConfig, yarn_frequencies
from dsjax.numerics import round_to


def rope_angles(cfg: ModelConfig, layer: int, positions):
    """float32 [..., rope_head_dim/2] angles for integer `positions` [...]."""
    freqs = jnp.asarray(yarn_frequencies(cfg, layer))
    return positions.astype(jnp.float32)[..., None] * freqs


def apply_rope(x, angles, *, inverse: bool = False):
    """Rotate the last `2*angles.shape[-1]` dims of x; `angles` broadcasts against x[..., :-rd] minus the last dim.

    x: [..., d]; angles: broadcastable to [..., rd/2]. Computed in float32, returned in x.dtype.
    """
    rd = 2 * angles.shape[-1]
    head, tail = x[..., :-rd], x[..., -rd:]
    t = tail.astype(jnp.float32).reshape(tail.shape[:-1] + (rd // 2, 2))
    re, im = t[..., 0], t[..., 1]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if inverse:
        sin = -sin
    # products materialised before the sums: the reference's complex multiply has no fused multiply-add
    rc, is_, rs, ic = jax.lax.optimization_barrier((re * cos, im * sin, re * sin, im * cos))
    out = jnp.stack([rc - is_, rs + ic], axis=-1).reshape(tail.shape)
    return jnp.concatenate([head, round_to(out, x.dtype)], axis=-1)

