"""Prefill / chunk attention: a chunk's queries over key segments with interval visibility (the window, HCA
entries) plus optional per-query picks (CSA), per-head sink."""

from dsjax.kernels.chunk_attention.api import (Segment, chunk_attention, compressed_segment, window_segment)

__all__ = ["Segment", "chunk_attention", "window_segment", "compressed_segment"]
