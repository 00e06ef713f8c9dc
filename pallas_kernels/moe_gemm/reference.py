"""The definition of the routed-expert GEMM, in plain jnp: every expert on every token, masked by the routing
weights (O(E); tests only). It is `dsjax.layers.moe.routed_experts_dense` written against the op's arguments.

x is FP8-fake-quantised (if asked) once; gate/up matmuls accumulate in fp32 and are rounded to the compute dtype;
SwiGLU with the clamp; the routing weight (summed over a token's picks of one expert) multiplies h before it is
rounded (and FP8-fake-quantised); the down projection is rounded; the per-token sum runs over the experts in
ascending order in fp32.
"""

import jax
import jax.numpy as jnp

from dsjax import quant
from dsjax.kernels.common import dequant_weight
from dsjax.layers import moe as _moe      # module, not names: dsjax.layers.moe may import this package
from dsjax.layers.linear import einsum_acc32
from dsjax.numerics import round_to, sum_in_order


def combine_weights(weights, ids, n_experts: int):
    """fp32 [n, E]: each token's routing weight per expert (repeated picks of one expert add up)."""
    return jnp.sum(jax.nn.one_hot(ids, n_experts, dtype=jnp.float32) * weights[..., None], axis=1)


def dense_weight(lin, dtype):
    """A stacked Linear as dense [E, out, in] values in `dtype` (what dsjax.layers.linear.dequantize gives)."""
    return dequant_weight(lin.weight, lin.scale, lin.fmt, lin.block).astype(dtype)


def expert_outputs(xq, combine, w1, w3, w2, *, swiglu_limit, act_quant_sim, act_quant_block):
    """xq [n, D], combine fp32 [n, S], dense w1/w3 [S, I, D], w2 [S, D, I] -> fp32 [n, D]: the S experts'
    rounded outputs summed in order."""
    dt = xq.dtype
    g = round_to(einsum_acc32("nd,eid->nei", xq, w1), dt).astype(jnp.float32)
    u = round_to(einsum_acc32("nd,eid->nei", xq, w3), dt).astype(jnp.float32)
    h = round_to(_moe.swiglu(g, u, swiglu_limit) * combine[..., None], dt)
    if act_quant_sim:
        h = quant.fp8_e4m3_sim(h, act_quant_block)
    y = round_to(einsum_acc32("nei,edi->ned", h, w2), dt)
    return sum_in_order(y.astype(jnp.float32), axis=1)


def moe_gemm(x, weights, ids, w1, w3, w2, *, swiglu_limit, act_quant_sim, act_quant_block):
    dt = x.dtype
    combine = combine_weights(weights, ids, w1.weight.shape[0])
    xq = quant.fp8_e4m3_sim(x, act_quant_block) if act_quant_sim else x
    return expert_outputs(xq, combine, *(dense_weight(m, dt) for m in (w1, w3, w2)), swiglu_limit=swiglu_limit,
                          act_quant_sim=act_quant_sim, act_quant_block=act_quant_block)
