"""Routed-expert GEMM (tokens x their active experts): the op contract and backend selection."""

from dsjax.kernels.common import check_implementation
from dsjax.kernels.moe_gemm import pallas_triton, reference, xla


def moe_gemm(x, weights, ids, w1, w3, w2, *, swiglu_limit: float, act_quant_sim: bool = False,
             act_quant_block: int = 128, implementation: str = "xla", **kernel_options):
    """fp32 [n, D]: each token's routed experts summed, as `dsjax.layers.moe.routed_experts_dense` computes it.

    x:        [n, D] compute dtype (bf16 in the model).
    weights:  fp32 [n, k] routing weights; 0 = a pick that is not on this shard (expert parallelism).
    ids:      int32 [n, k] expert ids local to the stacks below (0 <= id < E).
    w1, w3:   `dsjax.weights.Linear` stacks [E, I, D] (gate, up); w2: [E, D, I] (down). fmt 'bf16'/'f32', 'fp8'
              (e4m3 + ue8m0 block x block scales) or 'fp4' (packed e2m1, low nibble first + per-`block` ue8m0).
    swiglu_limit: clamp (silu(min(g, L)) · clip(u, ±L)); <= 0 = none. act_quant_sim / act_quant_block: FP8
              fake-quantise x and h per block, as the model's config says.
    Per expert: h = round(swiglu(round(x·W1ᵀ), round(x·W3ᵀ)) · weight), y = round(h·W2ᵀ) (fp32 accumulation);
    per token the expert outputs are summed in ascending expert order in fp32.

    implementation: "reference" (every expert, tests), "xla" (only the active experts: gathered for few tokens,
    `ragged_dot` for many), "pallas" (Triton-lowered kernels over (token, pick) pairs grouped by expert, bf16
    compute; the HLO interpreter off-GPU; FP4 experts on a GPU, where its shapes apply: the Mosaic GPU kernel of
    `mosaic_fp4`). kernel_options (block_m, block_i, block_d, block_k, num_warps, num_stages, target_programs,
    interpret, fp4_asm, fp8_mma, fp8_dot, fused, in_kernel_quant, codes_kernel, fp4_kernel, mosaic_block_k,
    mosaic_stages, mosaic_wait_per_linear, mosaic_k_splits, mosaic_pairs, mosaic_route_kernel, mosaic_route_warps,
    mosaic_programs, mosaic_early_sums, mosaic_pdl, mosaic_quad_waits, mosaic_stream_scales, mosaic_consumers,
    mosaic_prefetch_down, mosaic_down_prewait, mosaic_route_head: see
    `pallas_triton.moe_gemm`) go to the Pallas kernel only.
    """
    impl = check_implementation(implementation)
    opts = dict(swiglu_limit=swiglu_limit, act_quant_sim=act_quant_sim, act_quant_block=act_quant_block)
    if impl == "reference":
        return reference.moe_gemm(x, weights, ids, w1, w3, w2, **opts)
    if impl == "xla":
        return xla.moe_gemm(x, weights, ids, w1, w3, w2, **opts)
    return pallas_triton.moe_gemm(x, weights, ids, w1, w3, w2, **opts, **kernel_options)
