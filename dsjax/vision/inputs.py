"""Prompts with images -> expanded token ids and the rows their image spans embed as.

`prepare(params, cfg, prompts, images)` decodes and preprocesses every image, expands each prompt's placeholders
into spans (layout.py), runs the ViT and aligner once per image (tower.py, aligner.py) and returns `ImageRows`:
one device array holding every span's rows (row count bucketed to a power of two, so compiles are shared) and,
per prompt, each position's row in it (-1 for text). A prefill chunk takes `rows.chunk(...)`, its slice of that
index, and passes (rows.rows, index) as the model's `image` argument.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from dsjax.config import ModelConfig
from dsjax.errors import InputError
from dsjax.vision.decode import load_rgb
from dsjax.vision.layout import expand_placeholders
from dsjax.vision.preprocess import preprocess
from dsjax.vision.tower import encode_image


@dataclasses.dataclass
class ImageRows:
    rows: object                 # [R, D] span rows of every image (compute dtype), R a power of two
    index: list[np.ndarray]      # per prompt: int32 [len(prompt)], the row of each position, -1 for text
    kinds: list[np.ndarray]      # per prompt: int8 [len(prompt)], layout.TEXT / START / IMAGE / NEWLINE / END

    def chunk(self, slots: int, start: int, size: int) -> np.ndarray:
        """int32 [slots, size]: the rows of positions start..start+size of every prompt (-1 past its end)."""
        out = np.full((slots, size), -1, np.int32)
        for b, idx in enumerate(self.index):
            part = idx[start:start + size]
            out[b, :len(part)] = part
        return out


def _bucket(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def check_images(cfg: ModelConfig, prompts, images) -> list[list]:
    """`images`: one list of images per prompt; each prompt holds one `image_token_id` per image."""
    if not cfg.vision_enabled:
        raise InputError(f"{cfg.name} has no vision tower (vision_n_layers=0); images need a V4.1 model with one")
    if not isinstance(images, (list, tuple)) or len(images) != len(prompts):
        raise InputError(f"images must be a list with one list of images per prompt ({len(prompts)} prompts), "
                         f"got {type(images).__name__}" + (f" of {len(images)}" if isinstance(images, (list, tuple)) else ""))
    out = []
    for i, (prompt, imgs) in enumerate(zip(prompts, images)):
        imgs = [] if imgs is None else imgs
        if not isinstance(imgs, (list, tuple)):
            raise InputError(f"images[{i}] must be a list of images (bytes, a path, a data URL or an RGB array)")
        found = int(np.sum(np.asarray(prompt) == cfg.image_token_id))
        if found != len(imgs):
            raise InputError(f"prompt {i} holds {found} image placeholder(s) (token {cfg.image_token_id}) but "
                             f"{len(imgs)} image(s) were given; put one placeholder where each image goes")
        out.append(list(imgs))
    return out


@dataclasses.dataclass
class PreparedPrompt:
    """One prompt with its images preprocessed on the host (no device work yet)."""

    ids: np.ndarray               # int32: the prompt with every placeholder expanded into its span
    kinds: np.ndarray             # int8 per position: layout.TEXT / START / IMAGE / NEWLINE / END
    images: list                  # (bfloat16 patches, Grid, span start) per image, in order


def prepare_prompt(cfg: ModelConfig, prompt, images, *, name: str = "images") -> PreparedPrompt:
    """Decode + preprocess each image (ImageError on a bad one) and expand the placeholders."""
    pre = [preprocess(load_rgb(img, name=f"{name}[{j}]"), cfg) for j, img in enumerate(images)]
    ids, kinds, starts = expand_placeholders(prompt, [g for _, g in pre], cfg.image_token_id)
    return PreparedPrompt(ids=ids, kinds=kinds, images=[(p, g, at) for (p, g), at in zip(pre, starts)])


def encode_spans(params, cfg: ModelConfig, prompt: PreparedPrompt):
    """(span rows [Σ span lengths, D] in the compute dtype, int32 index [len(ids)]: each position's row, -1 text)."""
    if getattr(params, "vision", None) is None:
        raise InputError(f"{cfg.name} was loaded without its vision tower (ignore_vision=True); reload without it "
                         f"to pass images")
    index, spans, total = np.full(len(prompt.ids), -1, np.int32), [], 0
    for patches, grid, at in prompt.images:
        index[at:at + grid.span_length] = total + np.arange(grid.span_length, dtype=np.int32)
        total += grid.span_length
        spans.append(encode_image(params, jnp.asarray(patches), cfg=cfg, rows=grid.vit_rows, cols=grid.vit_cols))
    return jnp.concatenate(spans, axis=0).astype(jnp.dtype(cfg.compute_dtype)), index


def merge(parts) -> tuple[object, list[np.ndarray]]:
    """[(rows, index) or None per prompt] -> (all rows, padded to a power of two, and per-prompt indices into them)."""
    rows, out, total = [], [], 0
    for part in parts:
        if part is None:
            out.append(None)
            continue
        r, idx = part
        rows.append(r)
        out.append(np.where(idx >= 0, idx + total, -1).astype(np.int32))
        total += r.shape[0]
    merged = jnp.concatenate(rows, axis=0)
    return jnp.pad(merged, ((0, _bucket(total) - total), (0, 0))), out


def prepare(params, cfg: ModelConfig, prompts, images) -> tuple[list[np.ndarray], ImageRows | None]:
    """(expanded prompts, their ImageRows or None when no prompt has an image)."""
    images = check_images(cfg, prompts, images)
    if not any(images):
        return [np.asarray(p, np.int32) for p in prompts], None
    prepared = [prepare_prompt(cfg, p, imgs, name=f"images[{i}]") for i, (p, imgs) in enumerate(zip(prompts, images))]
    rows, index = merge([encode_spans(params, cfg, pp) if pp.images else None for pp in prepared])
    index = [np.full(len(pp.ids), -1, np.int32) if idx is None else idx for pp, idx in zip(prepared, index)]
    return [pp.ids for pp in prepared], ImageRows(rows=rows, index=index, kinds=[pp.kinds for pp in prepared])
