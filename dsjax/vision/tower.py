"""The V4.1 ViT: patch embedding, pre-norm blocks of 2D-rotary full attention and SwiGLU, a final RMSNorm.

Structure from the two public ports that cite DeepSeek's V4.1-Flash `inference/vision.py` line by line (a flax
port, "vision.py:46-103", and ModelScope mcore-bridge's `deepseek_v41.py`); the official file itself was not
available, so the numerics below are those ports' (and torch's bf16 conventions), not verified against it:

- patches [N, 3·p·p] (bf16) -> biased linear -> x [N, W];
- block: x += wo(attn(rope(q), rope(k), v)) with q | k | v = wqkv(rmsnorm1(x)) (biased, heads of W/heads);
  x += w2(silu(gate) · up) with gate | up = w1(rmsnorm2(x)) (no biases);
- RMSNorm eps 1e-6 in fp32; attention over the whole image (no mask), scale head_dim^-½;
- 2D rotary in fp32, theta `vision_rope_theta`: the head's first and second halves pair up (rotate-half); pair j
  of the first quarter turns with the patch's row, of the second quarter with its column, at frequency
  theta^(-4j/head_dim) (j counted within the quarter).

Activations are bf16 between ops, every op computing in fp32 and rounding once, as torch does on bf16 tensors.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsjax.config import ModelConfig
from dsjax.layers.norms import rms_norm
from dsjax.numerics import round_to, silu, softmax_exact
from dsjax.vision.weights import Dense, ViT

EPS = 1e-6
BF16 = jnp.bfloat16


def dense(x, d: Dense):
    """x @ weight.T (+ bias) in fp32, rounded once to bf16."""
    y = jnp.einsum("...i,oi->...o", x.astype(jnp.float32), d.weight.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
    if d.bias is not None:
        y = y + d.bias.astype(jnp.float32)
    return y.astype(BF16)


def rope_tables(rows: int, cols: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """float32 cos, sin [rows·cols, head_dim/2] of the row-major patch grid."""
    half = head_dim // 2
    inv = 1.0 / (theta ** (np.arange(0, half, 2, dtype=np.float32) / np.float32(half)))
    r, c = np.meshgrid(np.arange(rows, dtype=np.float32), np.arange(cols, dtype=np.float32), indexing="ij")
    angles = np.concatenate([r.reshape(-1, 1) * inv, c.reshape(-1, 1) * inv], axis=-1).astype(np.float32)
    return np.cos(angles), np.sin(angles)


def rotate(x, cos, sin):
    """x [N, heads, hd] bf16 -> rotated (first half a, second half b: a·cos - b·sin | b·cos + a·sin), bf16."""
    xf = x.astype(jnp.float32)
    a, b = jnp.split(xf, 2, axis=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1).astype(x.dtype)


def attention(x, w, cfg: ModelConfig, cos, sin):
    N = x.shape[0]
    H = cfg.vision_n_heads
    q, k, v = (t.reshape(N, H, -1) for t in jnp.split(dense(x, w.wqkv), 3, axis=-1))
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    scores = jnp.einsum("nhd,mhd->hnm", q.astype(jnp.float32), k.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST) * np.float32(q.shape[-1] ** -0.5)
    probs = softmax_exact(scores, axis=-1)
    out = jnp.einsum("hnm,mhd->nhd", probs, v.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return dense(out.astype(BF16).reshape(N, -1), w.wo)


def mlp(x, w):
    gate, up = jnp.split(dense(x, w.w1), 2, axis=-1)
    act = round_to(silu(gate.astype(jnp.float32)), BF16).astype(jnp.float32)
    return dense(round_to(act * up.astype(jnp.float32), BF16), w.w2)


def vit(w: ViT, cfg: ModelConfig, patches, rows: int, cols: int):
    """patches bf16 [rows·cols, 3·p·p] (row-major) -> features bf16 [rows·cols, vision_dim]."""
    cos, sin = (jnp.asarray(t) for t in rope_tables(rows, cols, cfg.vision_dim // cfg.vision_n_heads,
                                                      cfg.vision_rope_theta))
    x = dense(patches.astype(BF16), w.patch_embed.proj)
    for block in w.blocks:
        x = round_to(x.astype(jnp.float32) + attention(rms_norm(x, block.norm1, EPS), block.attn, cfg, cos, sin)
                     .astype(jnp.float32), BF16)
        x = round_to(x.astype(jnp.float32) + mlp(rms_norm(x, block.norm2, EPS), block.mlp).astype(jnp.float32), BF16)
    return rms_norm(x, w.norm, EPS)


@functools.partial(jax.jit, static_argnames=("cfg", "rows", "cols"))
def encode_image(params, patches, *, cfg: ModelConfig, rows: int, cols: int):
    """One image's patches -> its span rows bf16 [rows'·(cols'+1) + 2, D] (rows', cols' the aligner grid):
    image_start, each aligner row followed by image_newline, image_end."""
    from dsjax.vision.aligner import align, span_rows

    features = vit(params.vision, cfg, patches, rows, cols)
    return span_rows(params, align(params.aligner, cfg, features, rows, cols))
