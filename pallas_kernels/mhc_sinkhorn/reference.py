"""The definition: the model's own `sinkhorn_split` with its iterations written out (straight-line code),
not a copy."""

from dsjax.kernels.mhc_sinkhorn.xla import model_split


def mhc_sinkhorn(m, scale, base, *, n: int, iters: int, eps: float):
    return model_split(m, scale, base, n=n, iters=iters, eps=eps, unroll=True)
