"""Lightning-indexer scoring (FP4 index keys, ReLU-weighted head sum) and top-k with ties to the lower index."""

from dsjax.kernels.indexer_topk.api import index_scores, indexer_topk

__all__ = ["index_scores", "indexer_topk"]
