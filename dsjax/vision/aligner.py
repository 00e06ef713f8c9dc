"""The V4.1 aligner: 3x3 squares of ViT features -> one decoder-width row each; and the image span's rows.

Structure from the same ports as tower.py (flax port "vision.py:106-119, model.py:1228-1239"; mcore-bridge): the
patch grid is zero-padded at the bottom and right to whole `downsample` squares; each square's features are
concatenated channel-major, then (kernel row, kernel column) — torch `unfold`'s order; two biased linears with
an exact (erf) GELU between them map them to the decoder width. The span (official model.py,
`merge_image_embeddings`): image_start, the rows in reading order with image_newline after each grid row,
image_end.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsjax.config import ModelConfig
from dsjax.numerics import round_to
from dsjax.vision.tower import dense
from dsjax.vision.weights import Aligner


def squares(features, rows: int, cols: int, r: int):
    """features [rows·cols, C] -> [ceil(rows/r), ceil(cols/r), C·r·r], element c·r² + i·r + j of a square taken
    from patch (r·y + i, r·x + j), zeros past the grid."""
    C = features.shape[-1]
    grid = features.reshape(rows, cols, C)
    grid = jnp.pad(grid, ((0, -rows % r), (0, -cols % r), (0, 0)))
    R, K = grid.shape[0] // r, grid.shape[1] // r
    return grid.reshape(R, r, K, r, C).transpose(0, 2, 4, 1, 3).reshape(R, K, C * r * r)


def align(w: Aligner, cfg: ModelConfig, features, rows: int, cols: int):
    """ViT features bf16 [rows·cols, vision_dim] -> bf16 [ceil(rows/r), ceil(cols/r), D]."""
    x = dense(squares(features, rows, cols, cfg.vision_downsample_ratio), w.w1)
    x = round_to(jax.nn.gelu(x.astype(jnp.float32), approximate=False), jnp.bfloat16)
    return dense(x, w.w2)


def span_rows(params, grid):
    """Aligned grid [R, K, D] -> the span's rows [R·(K+1) + 2, D] in the grid's dtype."""
    R, K, D = grid.shape
    dt = grid.dtype
    newline = jnp.broadcast_to(params.image_newline.astype(dt), (R, 1, D))
    lines = jnp.concatenate([grid, newline], axis=1).reshape(R * (K + 1), D)
    return jnp.concatenate([params.image_start.astype(dt)[None], lines, params.image_end.astype(dt)[None]], axis=0)
