"""dsjax.kernels.quant_linear: the xla path (the model's `dsjax.layers.linear`) and the Pallas kernel (the HLO
interpreter on CPU; its buffers start as NaN, so an unwritten row shows) vs the reference, for bf16, FP8 with
V4's 128 x 128 and V4.1's 32 x 32 scale blocks and packed FP4 weights, at decode (1 row, split-K) and prefill
(40 rows: a partial row tile) and with a batch of leading dims; the kernel lowers for the H200 at V4-Flash's
projection shapes.

Tolerance: every path sums the same exact products (power-of-two scales, e4m3/e2m1 codes: exact in fp32) in fp32
in a different order, then rounds once to bf16. Two fp32 orders of n terms each lie within n·2^-24·Σ|x_k·w_k| of
the exact sum (the standard summation bound), so the rounded results differ by at most that twice plus one bf16
ulp of the larger (≤ 2^-7 of it). The summation term matters only where the sum cancels to well below its
terms (~3e-5 of Σ|x·w| here: a seed in CI found an output 1.2 ulps apart, a cancelled one); we also require
≥ 99% of the outputs to be identical. A wrong block scale, a mis-decoded nibble or a lost split is off by a
sizeable fraction of the output and fails both.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lower_h200 import lower_for_h200
from weight_formats import BLOCKS

from dsjax.kernels.common import dequant_weight
from dsjax.kernels.quant_linear import quant_linear
from dsjax.weights import Linear, stored_linear

OUT, IN = 256, 512


def _weight(key, fmt, out=OUT, inn=IN):
    return stored_linear(jax.random.normal(key, (out, inn), jnp.float32) * 0.05, *BLOCKS[fmt])


def _close(got, want, what, x, w):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape and np.isfinite(got).all(), what
    dense = np.abs(np.asarray(dequant_weight(w.weight, w.scale, w.fmt, w.block), np.float64))
    terms = np.abs(np.asarray(x, np.float64)) @ dense.T * 1.07   # Σ|x_k·w_k|; FP8 fake quant moves x ≤ 2^-4
    ulp = 2.0 ** -7 * np.maximum(np.maximum(np.abs(got), np.abs(want)), 2.0 ** -126)
    tol = ulp + 2 * IN * 2.0 ** -24 * terms
    worst = float(np.max(np.abs(got - want) / tol))
    same = float(np.mean(got == want))
    print(f"{what}: worst {worst:.2f} of the bound, {float(np.max(np.abs(got - want) / ulp)):.2f} bf16 ulp, "
          f"identical {same:.4f}")
    assert worst <= 1.0 and same >= 0.99, what


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8b32", "fp4"])
def test_paths_match_the_reference(test_seed, fmt):
    k = jax.random.split(jax.random.key(test_seed), 4)
    w = _weight(k[0], fmt)
    for lead, aq in (((1,), False), ((40,), True), ((2, 3), False)):
        x = jax.random.normal(k[1], (*lead, IN), jnp.float32).astype(jnp.bfloat16)
        want = quant_linear(x, w, act_quant_sim=aq, implementation="reference")
        assert want.dtype == jnp.bfloat16 and want.shape == (*lead, OUT)
        _close(quant_linear(x, w, act_quant_sim=aq, implementation="xla"), want, f"xla {fmt} {lead} aq={aq}", x, w)
        got = quant_linear(x, w, act_quant_sim=aq, implementation="pallas", interpret=True)
        _close(got, want, f"pallas {fmt} {lead} aq={aq}", x, w)


def test_decode_splits_the_contraction(test_seed):
    """One row: the kernel splits K (out / block_o programs alone cannot fill a GPU); the split partials must
    add up to the whole contraction."""
    from dsjax.kernels.moe_gemm.pallas_triton import k_splits

    assert k_splits(OUT // 64, IN // 128, 8 * 132) == 4
    k = jax.random.split(jax.random.key(test_seed + 1), 2)
    w = _weight(k[0], "fp8")
    x = jax.random.normal(k[1], (1, IN), jnp.float32).astype(jnp.bfloat16)
    want = quant_linear(x, w, implementation="reference")
    for target in (1, 8 * 132):       # no split vs 4 splits
        _close(quant_linear(x, w, implementation="pallas", interpret=True, target_programs=target), want,
               f"target {target}", x, w)


def test_bad_inputs_are_refused():
    w = _weight(jax.random.key(0), "fp8")
    with pytest.raises(ValueError, match="bf16 compute only"):
        quant_linear(jnp.zeros((1, IN), jnp.float32), w, implementation="pallas", interpret=True)
    with pytest.raises(ValueError, match="multiple of block_o"):
        quant_linear(jnp.zeros((1, IN), jnp.bfloat16), _weight(jax.random.key(0), "fp8", out=96),
                     implementation="pallas", interpret=True)
    with pytest.raises(ValueError, match="implementation"):
        quant_linear(jnp.zeros((1, IN), jnp.bfloat16), w, implementation="cuda")


@pytest.mark.parametrize("shape", [(1024, 4096), (32768, 1024)])   # V4-Flash wq_a, wq_b
def test_lowers_for_the_h200_at_v4_flash_shapes(shape):
    from dsjax.kernels.quant_linear import pallas_triton
    S = jax.ShapeDtypeStruct
    out, inn = shape
    w = Linear(S((out, inn), jnp.float8_e4m3fn), S((out // 128, inn // 128), jnp.uint8), "fp8", 128)
    f = lambda x, w: pallas_triton.quant_linear(x, w, interpret=False)  # noqa: E731
    assert lower_for_h200(f, S((1, inn), jnp.bfloat16), w).count("xla.gpu.triton") == 1


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the PTX decode runs only on an NVIDIA GPU")
def test_fp4_asm_equals_jnp_decode_on_gpu(test_seed):
    """On the GPU the PTX FP4 decode gives the kernel's jnp-decode output bit for bit (the same bf16 weights, then
    the same program), and both match the reference — the check the CPU interpreter cannot make."""
    k = jax.random.split(jax.random.key(test_seed), 2)
    w = _weight(k[0], "fp4")
    for rows in (1, 8, 40):
        x = jax.random.normal(k[1], (rows, IN), jnp.float32).astype(jnp.bfloat16)
        out = {asm: quant_linear(x, w, implementation="pallas", interpret=False, fp4_asm=asm) for asm in (False, True)}
        np.testing.assert_array_equal(np.asarray(out[True], np.float32), np.asarray(out[False], np.float32))
        _close(out[False], quant_linear(x, w, implementation="reference"), f"pallas fp4 {rows} rows", x, w)
