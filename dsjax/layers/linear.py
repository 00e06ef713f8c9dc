"""Linear layers over weights kept in their checkpoint formats (XLA path: dequantise per matmul).

The reference multiplies an FP8-quantised activation (per-row blocks along K, ue8m0 scales) with the FP8/FP4
weight, accumulating in fp32 and writing bf16. Scales are powers of two and e4m3·e2m1 products are exact in
fp32, so dequantise-then-matmul with fp32 accumulation equals it up to summation order.
"""

import math

import jax
import jax.numpy as jnp

from dsjax import quant
from dsjax.config import ModelConfig
from dsjax.kernel_choice import choose
from dsjax.sharding import active_mesh
from dsjax.weights import Linear
from dsjax.numerics import round_to


def dequantize(w: Linear, dtype):
    """The weight as a dense [.., out, in] array of `dtype` (exact for bf16 and f32)."""
    if w.fmt == "fp8":
        return quant.dequantize_fp8_blocks(w.weight, w.scale, w.block).astype(dtype)
    if w.fmt == "fp4":
        return quant.dequantize_fp4_packed(w.weight, w.scale, w.block).astype(dtype)
    return w.weight.astype(dtype)


def precision(dtype):
    """fp32 compute means fp32 matmuls (no TF32 on GPUs); bf16 inputs use the default."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def einsum_acc32(subscripts: str, a, b):
    """einsum with fp32 accumulation (fp32 result). bf16 products are exact in fp32, so where a backend
    has no bf16 x bf16 -> f32 dot (XLA:CPU) we upcast first: the same numbers, just slower."""
    prec = precision(a.dtype)
    if a.dtype != jnp.float32 and jax.default_backend() == "cpu":
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        prec = jax.lax.Precision.HIGHEST
    return jnp.einsum(subscripts, a, b, preferred_element_type=jnp.float32, precision=prec)


def matmul(x, w, out_dtype):
    """x [..., in] @ w[out, in].T with fp32 accumulation, rounded to out_dtype."""
    y = einsum_acc32("...i,oi->...o", x, w)
    return round_to(y, out_dtype)


def linear(x, w: Linear, cfg: ModelConfig):
    """y = x @ W.T in the compute dtype; FP8 activation fake-quant first when the config asks for it. Decode and
    verify sized inputs (≤ 32 rows in all) may take the stored-format kernel (`dsjax.kernels.quant_linear`, per
    `kernel_choice`): XLA writes an FP8 weight out dequantised before each matmul, the kernel decodes it in
    registers."""
    cdt = x.dtype
    if _kernel_fits(x, w) and choose(cfg, "quant_linear", rows=math.prod(x.shape[:-1]), dtype=cdt, fmt=w.fmt,
                                     chunk=x.shape[-2] if x.ndim > 2 else 1, sharded=active_mesh() is not None
                                     ) == "pallas":
        from dsjax.kernels.quant_linear import quant_linear   # the kernel's xla backend imports this module
        return quant_linear(x, w, act_quant_sim=cfg.act_quant_sim, act_quant_block=cfg.act_quant_block,
                            implementation="pallas")
    if cfg.act_quant_sim and w.fmt in ("fp8", "fp4"):
        x = quant.fp8_e4m3_sim(x, cfg.act_quant_block)
    return matmul(x, dequantize(w, cdt), cdt)


def _kernel_fits(x, w: Linear) -> bool:
    """The kernel's tiles divide this weight (2-D, out a multiple of 64, in of the contraction chunk); the
    model's shapes all do, some tiny test configs do not."""
    from dsjax.kernels.quant_linear.pallas_triton import fits
    return w.weight.ndim == 2 and fits(w, x.shape[-1])
