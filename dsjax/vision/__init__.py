"""V4.1 vision: image decoding, the official preprocessor's resize, the span layout, the ViT and the aligner.

    decode.py      bytes / path / data URL -> RGB, with size limits and clear errors
    preprocess.py  resize to the token budget, normalise, cut into patches
    layout.py      where an image's span sits in the token sequence
    weights.py     the ViT / aligner / span-vector weight tree
    tower.py       the ViT
    aligner.py     3x3 squares -> decoder rows; the span's rows
    inputs.py      prompts + images -> expanded prompts and the rows their spans embed as
"""

from dsjax.vision.decode import data_url_bytes, decode_image, load_rgb
from dsjax.vision.inputs import ImageRows, prepare
from dsjax.vision.layout import expand_placeholders, span_kinds
from dsjax.vision.preprocess import Grid, plan_grid, preprocess

__all__ = ["ImageRows", "Grid", "data_url_bytes", "decode_image", "expand_placeholders", "load_rgb", "plan_grid",
           "prepare", "preprocess", "span_kinds"]
