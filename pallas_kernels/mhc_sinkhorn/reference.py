"""The definition: the model's own `sinkhorn_split` with its iterations written out (straight-line code),
not a copy."""

import types

from dsjax.layers.hyper_connections import sinkhorn_split


def mhc_sinkhorn(m, scale, base, *, n: int, iters: int, eps: float):
    mix = types.SimpleNamespace(scale=scale, base=base)
    cfg = types.SimpleNamespace(hc_mult=n, hc_eps=eps, hc_sinkhorn_iters=iters)
    return sinkhorn_split(m, mix, cfg, unroll=True)
