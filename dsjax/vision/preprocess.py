"""An RGB image -> the ViT's patches: resize to the token budget, pad, normalise, cut into patches.

Follows DeepSeek's V4.1-Flash `inference/image_processor.py` (revision dba1be0a40aa45a94ad051997016db3960a90277;
read in a vendored copy that states it is byte-identical, and checked against token counts the official code
produced — see tests/test_vision.py). Our own code, the same arithmetic:

1. Images below `vision_min_pixels` are scaled up (both sides by sqrt(min_pixels / area), truncated to ints);
   `vision_max_wh_ratio` (None in the release) would first clamp the width.
2. The pixel size rounds up to whole patches. If the image span that grid implies —
   `rows * (cols + 1) + 2` positions, rows/cols = ceil(patches / downsample) — exceeds `vision_max_n_token`, the
   largest aspect-preserving size whose span fits is solved for in closed form.
3. Pillow's `ImageOps.pad` letterboxes the image into that size (bicubic, centred, grey 127 borders); pixels
   become x/255 -> (x - 0.5) / 0.5 in float32, rounded to bfloat16.
4. Patches are `patch_size` squares in row-major grid order, each flattened channel-major (c, y, x).
"""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np

from dsjax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Grid:
    """The resize plan of one image: pixel size, ViT patch grid, LLM token grid."""

    height: int       # pixels after the resize (multiples of patch_size)
    width: int
    vit_rows: int     # patch grid
    vit_cols: int
    rows: int         # aligner grid: ceil(vit / downsample)
    cols: int

    @property
    def span_length(self) -> int:
        """Positions of the image span: start, each row + a newline, end."""
        return self.rows * (self.cols + 1) + 2


def _token_grid(height: int, width: int, patch: int, down: int) -> tuple[int, int]:
    return -(-(height // patch) // down), -(-(width // patch) // down)


def _fit_budget(height, width, patch: int, down: int, budget: int) -> tuple[int, int]:
    """The largest aspect-preserving pixel size whose span fits `budget` positions.

    With r = h/w and a grid of c columns, c·r rows: c·r·(c+1) + 2 <= budget gives c = sqrt((budget-2)/r + 1/4) - 1/2.
    Degenerate aspect ratios collapse to a single column (tall) or a single row (wide), as the official code does."""
    aspect = height / width
    cols_f = math.sqrt((budget - 2) / aspect + 0.25) - 0.5
    rows_f = cols_f * aspect
    cell = patch * down
    if cols_f < 1.0:
        return (budget - 2) // 2 * cell, cell
    if rows_f < 1.0:
        return cell, (budget - 3) * cell
    scale = min(math.floor(cols_f) * cell / width, math.floor(rows_f) * cell / height)
    return math.floor(height * scale / patch) * patch, math.floor(width * scale / patch) * patch


def plan_grid(width: int, height: int, cfg: ModelConfig) -> Grid:
    """The resize plan for an image of `width` x `height` pixels (a pure function of the sizes and the config)."""
    p, down, budget = cfg.vision_patch_size, cfg.vision_downsample_ratio, cfg.vision_max_n_token
    if cfg.vision_max_wh_ratio is not None and width > height * cfg.vision_max_wh_ratio:
        width = height * cfg.vision_max_wh_ratio
    if 0 < width * height < cfg.vision_min_pixels:
        grow = (cfg.vision_min_pixels / (width * height)) ** 0.5
        width, height = int(width * grow), int(height * grow)
    best_h, best_w = math.ceil(height / p) * p, math.ceil(width / p) * p
    rows, cols = _token_grid(best_h, best_w, p, down)
    if rows * (cols + 1) + 2 > budget:
        best_h, best_w = _fit_budget(height, width, p, down, budget)
        rows, cols = _token_grid(best_h, best_w, p, down)
    grid = Grid(best_h, best_w, best_h // p, best_w // p, rows, cols)
    assert grid.span_length <= budget and grid.vit_rows > 0 and grid.vit_cols > 0, (width, height, grid)
    return grid


def resize(rgb: np.ndarray, grid: Grid, cfg: ModelConfig) -> np.ndarray:
    """uint8 [H, W, 3] -> uint8 [grid.height, grid.width, 3]: letterboxed (or stretched past max_wh_ratio)."""
    from PIL import Image, ImageOps

    image = Image.fromarray(rgb, "RGB")
    h, w = rgb.shape[:2]
    if cfg.vision_max_wh_ratio is not None and w >= cfg.vision_max_wh_ratio * h:
        out = image.resize((grid.width, grid.height))
    else:
        out = ImageOps.pad(image, (grid.width, grid.height), color=(127, 127, 127))
    return np.asarray(out, dtype=np.uint8)


def normalise(pixels: np.ndarray) -> np.ndarray:
    """uint8 [H, W, 3] -> bfloat16 [3, H, W] in [-1, 1]: the float32 steps the official code takes, then RNE."""
    x = np.ascontiguousarray(pixels.transpose(2, 0, 1)).astype(np.float32) / np.float32(255)
    return ((x - np.float32(0.5)) / np.float32(0.5)).astype(ml_dtypes.bfloat16)


def patchify(x: np.ndarray, patch: int) -> np.ndarray:
    """[3, H, W] -> [(H/p)·(W/p), 3·p·p]: row-major patches, each channel-major."""
    c, h, w = x.shape
    return x.reshape(c, h // patch, patch, w // patch, patch).transpose(1, 3, 0, 2, 4).reshape(-1, c * patch * patch)


def preprocess(rgb: np.ndarray, cfg: ModelConfig) -> tuple[np.ndarray, Grid]:
    """uint8 [H, W, 3] -> (bfloat16 patches [vit_rows·vit_cols, 3·p·p], grid)."""
    grid = plan_grid(rgb.shape[1], rgb.shape[0], cfg)
    return patchify(normalise(resize(rgb, grid, cfg)), cfg.vision_patch_size), grid
