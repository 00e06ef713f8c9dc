"""Where an image sits in the token sequence.

Each image placeholder (`image_token_id`, one per image) expands into a span of `rows·(cols+1) + 2` positions,
every one carrying `image_token_id` (V4.1-Flash `inference/image_processor.py`, `prepare_vl_inputs`):

    START, (IMAGE × cols, NEWLINE) × rows, END

Only the position's kind tells them apart. START / NEWLINE / END take the learned `image_start` /
`image_newline` / `image_end` vectors, IMAGE slots the aligner's rows in reading order.
"""

from __future__ import annotations

import numpy as np

TEXT, START, IMAGE, NEWLINE, END = -1, 0, 1, 2, 3


def span_kinds(rows: int, cols: int) -> np.ndarray:
    """int8 [rows·(cols+1) + 2]: the kind of each position of one image's span."""
    line = np.full(cols + 1, IMAGE, np.int8)
    line[-1] = NEWLINE
    return np.concatenate([[START], np.tile(line, rows), [END]]).astype(np.int8)


def expand_placeholders(prompt, grids, image_token_id: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """A prompt holding one `image_token_id` per image -> (token ids with each placeholder replaced by its span,
    int8 kinds per position (TEXT outside spans), each span's start). `grids` are the images' `Grid`s in order."""
    prompt = np.asarray(prompt, np.int32)
    at = np.flatnonzero(prompt == image_token_id)
    assert len(at) == len(grids), (len(at), len(grids))
    pieces, kinds, starts, prev, length = [], [], [], 0, 0
    for pos, grid in zip(at, grids):
        text = prompt[prev:pos]
        span = span_kinds(grid.rows, grid.cols)
        pieces += [text, np.full(len(span), image_token_id, np.int32)]
        kinds += [np.full(len(text), TEXT, np.int8), span]
        starts.append(length + len(text))
        length += len(text) + len(span)
        prev = pos + 1
    pieces.append(prompt[prev:])
    kinds.append(np.full(len(prompt) - prev, TEXT, np.int8))
    return np.concatenate(pieces).astype(np.int32), np.concatenate(kinds).astype(np.int8), starts
