"""Dense quantised linear (the attention projections, the shared expert): the op contract and backend selection.

Why an op: at decode the XLA path writes each FP8 weight out dequantised to bf16 before the matmul (11% of a
V4-Flash decode step's kernel time in the H200 profile, docs/benchmarks.md, issue 9); the kernel reads the
stored codes once and applies the block scales in registers.
"""

from dsjax import quant
from dsjax.kernels.common import check_implementation
from dsjax.kernels.quant_linear import pallas_triton, reference, xla


def quant_linear(x, w, *, act_quant_sim: bool = False, act_quant_block: int = 128, implementation: str = "xla",
                 **kernel_options):
    """[..., out] in x's dtype: round(x' · Wᵀ) with fp32 accumulation, as `dsjax.layers.linear.linear` computes it.

    x:  [..., in] compute dtype (bf16 in the model; fp32 for the reference and xla paths only).
    w:  `dsjax.weights.Linear` [out, in]: fmt 'bf16'/'f32', 'fp8' (e4m3 + ue8m0 block x block scales) or 'fp4'
        (packed e2m1, low nibble first + per-`block` ue8m0 scales along in).
    act_quant_sim / act_quant_block: x' = x FP8-fake-quantised per block first (FP8/FP4 weights only, as the
        model's config says); otherwise x' = x.

    implementation: "reference" (fp32 dequantise + matmul, tests), "xla" (the model's path), "pallas" (the
    routed-expert kernel's grouped GEMM with one group: split-K at decode, Triton lowering, bf16 compute; the HLO
    interpreter off-GPU). kernel_options (block_m, block_o, block_k, num_warps, num_stages, target_programs,
    interpret, fp4_asm) go to the Pallas kernel only.
    """
    impl = check_implementation(implementation)
    if act_quant_sim and w.fmt in ("fp8", "fp4"):
        x = quant.fp8_e4m3_sim(x, act_quant_block)   # the same rounding for every backend
    if impl == "reference":
        return reference.quant_linear(x, w)
    if impl == "xla":
        return xla.quant_linear(x, w)
    return pallas_triton.quant_linear(x, w, **kernel_options)
