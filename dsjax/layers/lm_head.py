"""The LM head: fp32 rows against the bf16 head weight, at fp32 accuracy, on tensor cores where that pays.

The reference computes the head in fp32. XLA's fp32 dot at `Precision.HIGHEST` is a fast reduce at one row (it
reads the weight at the copy rate), but at a verify step's few rows it becomes a Triton GEMM on fp32 FMA: 1.15 ms
for 6 rows of V4.1-Flash's 129,280 x 5,120 head on an H200, vs 0.30 ms for one row (docs/benchmarks.md). Splitting
each fp32 row exactly into three bf16 parts (`split_bf16x3`) and running one bf16 matmul with fp32 accumulation
gives the same products (a bf16 x bf16 product is exact in fp32) on tensor cores: 0.32 ms for 6 rows. On the CPU
only the summation order differs; on the H200 the split measured 6-7e-6 of the largest logit from a float64
product vs 2-3e-6 for the fp32 GEMM (the tensor cores' accumulation, most likely) — one row keeps the fp32 reduce
(1e-7), which is also as fast there.
"""

import jax
import jax.numpy as jnp

# the split's [3, rows, V] fp32 partial logits are a temporary 3x the logits; past this many rows the fp32 dot runs
# as a full-size GEMM anyway (prefill's every-token logits, training)
SPLIT_MAX_ROWS = 256


def lm_head(y, w, method: str = "auto"):
    """y [..., D] (any float) x w [V, D] -> fp32 logits [..., V].

    method: "fp32" — one fp32 dot at HIGHEST precision; "bf16x3" — the exact three-way split (bf16 `w` only);
    "auto" — the split for 2..SPLIT_MAX_ROWS rows of a bf16 weight, the fp32 dot otherwise. Training asks for
    "fp32": the split's backward pass would round the rows' gradient to bf16.
    """
    y = y.astype(jnp.float32)
    rows = y.size // y.shape[-1]
    if method == "auto":
        method = "bf16x3" if w.dtype == jnp.bfloat16 and 2 <= rows <= SPLIT_MAX_ROWS else "fp32"
    if method == "fp32":
        return jnp.einsum("...d,vd->...v", y, w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    if method != "bf16x3" or w.dtype != jnp.bfloat16:
        raise ValueError(f"lm_head: method {method!r} with a {w.dtype} weight; use 'auto', 'fp32' or 'bf16x3' (bf16)")
    parts = jnp.einsum("k...d,vd->k...v", split_bf16x3(y), w, preferred_element_type=jnp.float32)
    return (parts[0] + parts[1]) + parts[2]


def split_bf16x3(y):
    """fp32 [..., D] -> bf16 [3, ..., D] (hi, mid, lo) summing to y exactly for normal-range values: each part is
    the remainder rounded to bf16's 8 significant bits, so the last remainder fits in 8 bits.

    The roundings are `reduce_precision`, which XLA must keep: a plain f32 -> bf16 -> f32 round trip is one that
    XLA's GPU pipeline may drop ("excess precision"), which made the remainders zero — logits at bf16 accuracy.
    """
    hi = jax.lax.reduce_precision(y, exponent_bits=8, mantissa_bits=7)
    r = y - hi
    mid = jax.lax.reduce_precision(r, exponent_bits=8, mantissa_bits=7)
    return jnp.stack([hi, mid, r - mid]).astype(jnp.bfloat16)
