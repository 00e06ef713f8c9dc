"""Lightning-indexer scoring + top-k: the op contract and backend selection."""

from dsjax.kernels.common import IndexRowFormat, check_implementation, pick_backend
from dsjax.kernels.indexer_topk import pallas_gpu, pallas_triton, reference, xla


def indexer_topk(q, weights, keys, n_visible, k: int, *, row_format: IndexRowFormat = IndexRowFormat(),
                 implementation: str = "xla", tile: int = 4096, **kernel_options):
    """The top-k visible compressed entries per query, as `index_scores` + `select_topk` of dsjax.layers.indexer.

    q:         [B, Q, nh, dh] fake-quantised index queries (compute dtype; `index_queries`).
    weights:   [B, Q, nh] per-head weights, already scaled and rounded to the compute dtype
               (round(x @ weights_proj.T · dh^-½ · nh^-½), as `index_scores` computes them).
    keys:      [B, N, R] the index-key cache (IndexerState entries): uint8 68-byte FP4 rows (`row_format`) or
               values [B, N, dh].
    n_visible: int32 [B, Q]: entries j < n_visible are visible ((q_pos+1)//ratio, `compressed_visible`).
    Returns (indices int32 [B, Q, k'], valid bool [B, Q, k']), k' = min(k, N): the highest scores, ties to the
    lower index; picks beyond the visible entries are marked invalid.

    implementation: "reference" | "xla" | "pallas" (Triton-lowered scoring kernel + the two-stage top-k; the HLO
    interpreter off-GPU). tile: the first top-k stage's width. kernel_options (block_n, num_warps, num_stages,
    interpret) go to the Pallas path only; backend="mosaic" selects the Mosaic GPU (wgmma) scoring kernel
    instead of the Triton one.
    """
    impl = check_implementation(implementation)
    args = (q, weights, keys, n_visible, k)
    if impl == "reference":
        return reference.indexer_topk(*args, row_format=row_format)
    if impl == "xla":
        return xla.indexer_topk(*args, row_format=row_format, tile=tile)
    module = pick_backend(kernel_options, {"triton": pallas_triton, "mosaic": pallas_gpu})
    return module.indexer_topk(*args, row_format=row_format, tile=tile, **kernel_options)


def index_scores(q, weights, keys, n_visible, *, row_format: IndexRowFormat = IndexRowFormat(),
                 implementation: str = "xla", **kernel_options):
    """The scores alone, fp32 [B, Q, N] holding compute-dtype values, for callers that work on them before the
    top-k (V4.1's candidate blocks) or pick over a whole prefill chunk. Arguments as `indexer_topk`'s. Entries
    past a query's n_visible are undefined (a kernel writes -inf in tiles no row of its program sees): mask them.

    implementation "pallas": the Mosaic GPU kernel unless backend="triton"; its `rows_per_program` (default
    `pallas_gpu.default_rows`) sets how many query rows share each key tile."""
    impl = check_implementation(implementation)
    if impl == "reference":
        return reference.index_scores(q, weights, keys, row_format).astype("float32")
    if impl == "xla":
        return xla.index_scores(q, weights, keys, row_format)
    kernel_options.setdefault("backend", "mosaic")
    module = pick_backend(kernel_options, {"triton": pallas_triton, "mosaic": pallas_gpu})
    return module.index_scores(q, weights, keys, n_visible, row_format, **kernel_options)
