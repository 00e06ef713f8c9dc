"""Manifold-constrained hyper-connections (mHC): n residual streams mixed by a Sinkhorn-projected matrix.

All mixing runs in fp32 as in the reference; results are cast back to the stream dtype.
"""

import jax
import jax.numpy as jnp

from dsjax.config import ModelConfig
from dsjax.kernel_choice import choose
from dsjax.sharding import active_mesh
from dsjax.weights import HcHead, HyperMix
from dsjax.numerics import div_exact, materialize, mean_exact, round_to, sigmoid, sum_in_order


def _mixes(h, fn, eps):
    """h [b,s,n,D] -> (flat fp32 h, fn(h)·rsqrt(mean(h²)+eps)) — one statistic per token over all n·D."""
    x = h.reshape(h.shape[:-2] + (-1,)).astype(jnp.float32)
    rsqrt = jax.lax.rsqrt(mean_exact(x * x, axis=-1) + eps)
    m = jnp.einsum("...k,rk->...r", x, fn, precision=jax.lax.Precision.HIGHEST) * rsqrt
    return x, m


def sinkhorn_split(m, mix: HyperMix, cfg: ModelConfig, unroll: bool = False):
    """Mixes [.., (2+n)n] -> pre [.., n], post [.., n], comb [.., n(j), n(k)] (rows j = old stream).

    unroll: the Sinkhorn iterations as straight-line code instead of a scan: same operations, same order (the
    op's readable reference; the scan is faster on CPU and GPU alike)."""
    n, eps = cfg.hc_mult, cfg.hc_eps
    pre = sigmoid(m[..., :n] * mix.scale[0] + mix.base[:n]) + eps
    post = 2 * sigmoid(m[..., n:2 * n] * mix.scale[1] + mix.base[n:2 * n])
    c = (m[..., 2 * n:] * mix.scale[2] + mix.base[2 * n:]).reshape(m.shape[:-1] + (n, n))
    c = jnp.exp(c - jnp.max(c, axis=-1, keepdims=True))
    c = div_exact(c, jnp.sum(c, axis=-1, keepdims=True)) + eps
    c = div_exact(c, jnp.sum(c, axis=-2, keepdims=True) + eps)

    def step(c, _):
        c = div_exact(c, jnp.sum(c, axis=-1, keepdims=True) + eps)
        c = div_exact(c, jnp.sum(c, axis=-2, keepdims=True) + eps)
        return c, None

    if unroll:
        for _ in range(cfg.hc_sinkhorn_iters - 1):
            c, _ = step(c, None)
    else:
        c, _ = jax.lax.scan(step, c, None, length=cfg.hc_sinkhorn_iters - 1)
    return pre, post, c


def mixes_split(m, mix: HyperMix, cfg: ModelConfig, dtype):
    """`sinkhorn_split` through the op `dsjax.kernels.mhc_sinkhorn` (its XLA path, or the fused kernel where
    `dsjax.kernel_choice` picks it for streams of `dtype`)."""
    from dsjax.kernels.mhc_sinkhorn import mhc_sinkhorn
    impl = choose(cfg, "mhc_sinkhorn", rows=int(m.size // m.shape[-1]), dtype=dtype,
                  sharded=active_mesh() is not None)   # a pallas_call is not partitioned by GSPMD
    return mhc_sinkhorn(m, mix.scale, mix.base, n=cfg.hc_mult, iters=cfg.hc_sinkhorn_iters, eps=cfg.hc_eps,
                        implementation=impl)


def hc_pre(h, mix: HyperMix, cfg: ModelConfig):
    """Collapse the n streams into one sub-layer input. Returns (x [b,s,D], post, comb)."""
    x, m = _mixes(h, mix.fn, cfg.norm_eps)
    pre, post, comb = mixes_split(m, mix, cfg, h.dtype)
    y = sum_in_order(materialize(pre[..., None] * x.reshape(h.shape)), axis=-2)
    return round_to(y, h.dtype), post, comb


def hc_post(o, residual, post, comb):
    """New stream k = post_k·o + Σ_j comb[j,k]·residual_j, in fp32, cast to o's dtype."""
    mixed = sum_in_order(materialize(comb[..., None] * residual.astype(jnp.float32)[..., :, None, :]), axis=-3)
    y = materialize(post[..., None] * o.astype(jnp.float32)[..., None, :]) + mixed
    return round_to(y, o.dtype)


def hc_head(h, head: HcHead, cfg: ModelConfig):
    """Final collapse of the streams: Σ_i (sigmoid(m_i·scale + base_i) + eps)·h_i."""
    x, m = _mixes(h, head.fn, cfg.norm_eps)
    pre = sigmoid(m * head.scale + head.base) + cfg.hc_eps
    return round_to(sum_in_order(materialize(pre[..., None] * x.reshape(h.shape)), axis=-2), h.dtype)
