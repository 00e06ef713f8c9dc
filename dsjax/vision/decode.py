"""Image bytes -> RGB pixels, with limits checked before any pixel is decoded.

DeepSeek's preprocessor (V4.1-Flash `inference/image_processor.py`, revision dba1be0a) opens images with Pillow
and converts them to RGB; so do we, so that the pixels the resize sees are the ones the official code sees. Every
failure is an `ImageError` naming the image and what would be accepted.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import warnings

import numpy as np

from dsjax.errors import ImageError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
MAX_BYTES = 20 << 20        # encoded size
MAX_PIXELS = 40_000_000     # width x height before the resize (a 40-megapixel photo decodes to 120 MB of RGB)


def decode_image(data: bytes, *, name: str = "image", max_bytes: int = MAX_BYTES,
                 max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """Encoded bytes (PNG, JPEG, WebP, GIF's first frame, BMP) -> uint8 [height, width, 3] RGB."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ImageError(f"{name}: expected encoded image bytes, got {type(data).__name__}")
    if len(data) == 0:
        raise ImageError(f"{name}: empty (0 bytes)")
    if len(data) > max_bytes:
        raise ImageError(f"{name}: {len(data):,} bytes exceeds the limit of {max_bytes:,} bytes")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(bytes(data)))
    except UnidentifiedImageError:
        raise ImageError(f"{name}: not a recognised image (supported formats: {', '.join(FORMATS)})") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageError(f"{name}: too many pixels ({e})") from None
    except OSError as e:
        raise ImageError(f"{name}: corrupt image ({e})") from None
    with image:
        if image.format not in FORMATS:
            raise ImageError(f"{name}: unsupported format {image.format}; supported formats: {', '.join(FORMATS)}")
        width, height = image.size
        if width == 0 or height == 0:
            raise ImageError(f"{name}: zero size ({width}x{height})")
        if width * height > max_pixels:
            raise ImageError(f"{name}: {width}x{height} = {width * height:,} pixels exceeds the limit of "
                             f"{max_pixels:,} pixels")
        try:
            rgb = image.convert("RGB")
            rgb.load()
        except (OSError, SyntaxError, ValueError) as e:  # truncated or damaged pixel data
            raise ImageError(f"{name}: corrupt {image.format} data ({e})") from None
    return np.asarray(rgb, dtype=np.uint8)


def data_url_bytes(url: str, *, name: str = "image_url") -> bytes:
    """The payload of a base64 `data:image/...;base64,...` URL."""
    header, sep, payload = url.partition(",")
    if not sep or not header.startswith("data:"):
        raise ImageError(f"{name}: not a data URL (expected data:image/<type>;base64,<payload>)")
    media = header[len("data:"):].split(";")
    if not media[0].startswith("image/"):
        raise ImageError(f"{name}: data URL media type {media[0]!r} is not an image type (image/png, image/jpeg, ...)")
    if "base64" not in media[1:]:
        raise ImageError(f"{name}: only base64 data URLs are supported (data:{media[0]};base64,...)")
    if len(payload) > MAX_BYTES * 4 // 3 + 4:
        raise ImageError(f"{name}: data URL payload exceeds the limit of {MAX_BYTES:,} decoded bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{name}: data URL payload is not valid base64") from None


def image_bytes(source, *, name: str = "image") -> bytes | np.ndarray:
    """What an image argument holds: bytes as they are, a `data:` URL's payload, a file's bytes, or an RGB array.

    Remote URLs are not fetched here; the serving layer decides whether to fetch them."""
    if isinstance(source, np.ndarray):
        return source
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        if text.startswith("data:"):
            return data_url_bytes(text, name=name)
        if text.startswith(("http://", "https://")):
            raise ImageError(f"{name}: remote URLs are not fetched; pass the image's bytes, a file path or a data URL")
        try:
            with open(text, "rb") as f:
                return f.read(MAX_BYTES + 1)
        except OSError as e:
            raise ImageError(f"{name}: cannot read {text!r} ({e.strerror or e})") from None
    raise ImageError(f"{name}: expected bytes, a file path, a data URL or a uint8 [H, W, 3] array, "
                     f"got {type(source).__name__}")


def load_rgb(source, *, name: str = "image") -> np.ndarray:
    """Any accepted image argument -> uint8 [height, width, 3]."""
    data = image_bytes(source, name=name)
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8 or data.ndim != 3 or data.shape[2] != 3:
            raise ImageError(f"{name}: an array image must be uint8 [height, width, 3], got {data.dtype} {data.shape}")
        if data.shape[0] == 0 or data.shape[1] == 0:
            raise ImageError(f"{name}: zero size ({data.shape[1]}x{data.shape[0]})")
        if data.shape[0] * data.shape[1] > MAX_PIXELS:
            raise ImageError(f"{name}: {data.shape[1]}x{data.shape[0]} exceeds the limit of {MAX_PIXELS:,} pixels")
        return data
    return decode_image(data, name=name)
