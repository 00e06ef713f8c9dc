"""mHC split + Sinkhorn: the op contract and backend selection.

The profile of a V4-Flash decode step on the H200 (docs/benchmarks.md, "Where a step's time goes") put ~21% of
the device time in `sinkhorn_split`: a `lax.scan` of 19 Sinkhorn iterations over [tokens, 4, 4] matrices, twice a
layer, each iteration a few tiny kernels plus the loop's own. The op computes the whole split — pre / post gates
and the doubly-stochastic comb matrix — in one pass over the tokens.
"""

from __future__ import annotations

from dsjax.kernels.common import check_implementation


def mhc_sinkhorn(m, scale, base, *, n: int, iters: int, eps: float, implementation: str = "xla", **kernel_options):
    """m [..., (2+n)·n] fp32 mixes; scale [3], base [(2+n)·n] fp32 -> (pre [..., n], post [..., n],
    comb [..., n, n]) exactly as `dsjax.layers.hyper_connections.sinkhorn_split` defines them.

    implementation: "reference" (the iterations written out), "xla" (the model's scan),
    "pallas" (Triton-lowered: each of the n² comb entries a [rows] vector in registers; the HLO interpreter
    off-GPU). kernel_options (block_rows, num_warps, interpret) go to the kernel only.
    """
    from dsjax.kernels.mhc_sinkhorn import pallas_triton, reference, xla
    impl = check_implementation(implementation)
    args = (m, scale, base)
    kw = dict(n=n, iters=iters, eps=eps)
    if impl == "reference":
        return reference.mhc_sinkhorn(*args, **kw)
    if impl == "xla":
        return xla.mhc_sinkhorn(*args, **kw)
    return pallas_triton.mhc_sinkhorn(*args, **kw, **kernel_options)
