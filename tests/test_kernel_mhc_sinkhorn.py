"""dsjax.kernels.mhc_sinkhorn: the XLA path (the model's scan) and the Triton-lowered kernel (the HLO interpreter on
CPU: outputs start as NaN, so anything unwritten shows) equal the written-out iterations on fresh random mixes
(V4's n = 4, 20 iterations); the kernel lowers for CUDA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from lower_h200 import lower_for_h200

from dsjax.kernels.mhc_sinkhorn import mhc_sinkhorn

N, ITERS, EPS = 4, 20, 1e-6


def _case(seed, rows=150):
    ks = jax.random.split(jax.random.key(seed), 3)
    m = jax.random.normal(ks[0], (2, rows // 2, (2 + N) * N), jnp.float32) * 3.0
    scale = jax.random.uniform(ks[1], (3,), jnp.float32, 0.5, 2.0)
    base = jax.random.normal(ks[2], ((2 + N) * N,), jnp.float32)
    return m, scale, base


# The divides (the default) and the reciprocals are each checked once: blocking is independent of which
# (interpreting the 640 unrolled divides costs 16 s a case on this CPU, the reciprocal form 3 s).
@pytest.mark.parametrize("implementation,reciprocal,rows", [("xla", False, 150), ("pallas", True, 150),
                                                             ("pallas", False, 12)])
def test_matches_the_reference(test_seed, implementation, reciprocal, rows):
    """150 rows in 64-row blocks (the last one partly padding); 12 rows: the default one-warp, 32-row program of
    decode / verify calls, with the default divides."""
    m, scale, base = _case(test_seed, rows)
    kw = dict(n=N, iters=ITERS, eps=EPS)
    opts = dict(interpret=True, reciprocal=reciprocal) if implementation == "pallas" else {}
    if rows > 32 and implementation == "pallas":
        opts["block_rows"] = 64
    want = mhc_sinkhorn(m, scale, base, **kw, implementation="reference")
    got = mhc_sinkhorn(m, scale, base, **kw, implementation=implementation, **opts)
    for g, w, name in zip(got, want, ("pre", "post", "comb")):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape and np.all(np.isfinite(g)), name
        # fp32 throughout; the unrolled / fused forms may order a 4-term sum differently, and a reciprocal then a
        # multiply is within 1.5 ulp of a divide (renormalised every pass, so it does not grow): a few ulp of values ≤ 2
        np.testing.assert_allclose(g, w, rtol=2e-6, atol=1e-7, err_msg=name)
    comb = np.asarray(got[2])
    np.testing.assert_allclose(comb.sum(axis=-2), 1.0, atol=1e-3)   # doubly stochastic after the last column pass


def test_pallas_lowers_for_h200():
    S = jax.ShapeDtypeStruct
    from dsjax.kernels.mhc_sinkhorn import pallas_triton
    text = lower_for_h200(lambda m, s, b: pallas_triton.mhc_sinkhorn(m, s, b, n=N, iters=ITERS, eps=EPS, interpret=False),
                          S((1, 2048, (2 + N) * N), jnp.float32), S((3,), jnp.float32), S(((2 + N) * N,), jnp.float32))
    assert "xla.gpu.triton" in text
