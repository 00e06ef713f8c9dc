"""Sparse shared-KV MQA decode attention (window + selected compressed entries, per-head sink)."""

from dsjax.kernels.sparse_mqa.api import csa_indices, hca_indices, sparse_mqa_decode, window_indices, window_rows

__all__ = ["sparse_mqa_decode", "window_rows", "window_indices", "hca_indices", "csa_indices"]
