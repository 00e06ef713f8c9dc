"""XLA routed-expert GEMM over the distinct active experts only.

Few (token, pick) pairs (n·k < E, decode): the distinct active experts (`active_experts`, ascending) are gathered
from the stacked weights, so each is read once, and every token runs through them masked by its routing weights
— the reference's math with E replaced by the active set. Many pairs (prefill): pairs sorted by expert, one
`jax.lax.ragged_dot` per projection over the whole stack, outputs summed per token in ascending expert order.
"""

import jax
import jax.numpy as jnp

from dsjax import quant
from dsjax.kernels.common import dequant_weight
from dsjax.kernels.moe_gemm.reference import combine_weights, dense_weight, expert_outputs
from dsjax.layers import moe as _moe
from dsjax.numerics import round_to, sum_in_order


def active_experts(weights, ids, n_experts: int):
    """int32 [S] (S = min(n·k, E)): the distinct experts some token picks with a nonzero weight, ascending,
    padded with -1. Computed outside any kernel (the kernel's grid walks this list)."""
    n_slots = min(ids.size, n_experts)
    picked = jnp.where(weights != 0, ids, n_experts).reshape(-1)
    act = jnp.unique(picked, size=n_slots, fill_value=n_experts)
    return jnp.where(act < n_experts, act, -1).astype(jnp.int32)


def active_combine(weights, ids, active, n_experts: int):
    """fp32 [n, S]: each token's routing weight for each active slot (0 for padding slots)."""
    combine = combine_weights(weights, ids, n_experts)
    return jnp.where(active >= 0, jnp.take(combine, jnp.maximum(active, 0), axis=1), 0.0)


def _take_experts(lin, experts):
    return type(lin)(lin.weight[experts], None if lin.scale is None else lin.scale[experts], lin.fmt, lin.block)


def gathered(x, weights, ids, w1, w3, w2, *, swiglu_limit, act_quant_sim, act_quant_block):
    E, dt = w1.weight.shape[0], x.dtype
    active = active_experts(weights, ids, E)
    combine = active_combine(weights, ids, active, E)
    sel = jnp.maximum(active, 0)
    xq = quant.fp8_e4m3_sim(x, act_quant_block) if act_quant_sim else x
    dense = (dense_weight(_take_experts(m, sel), dt) for m in (w1, w3, w2))
    return expert_outputs(xq, combine, *dense, swiglu_limit=swiglu_limit, act_quant_sim=act_quant_sim,
                          act_quant_block=act_quant_block)


def merged_pair_weights(weights, ids):
    """fp32 [n, k]: a token's repeated picks of one expert summed onto its first pick, 0 on the repeats."""
    same = ids[:, :, None] == ids[:, None, :]
    total = jnp.sum(jnp.where(same, weights[:, None, :], 0.0), axis=-1)
    k = ids.shape[1]
    earlier = jnp.any(same & (jnp.arange(k)[None, :] < jnp.arange(k)[:, None]), axis=-1)
    return jnp.where(earlier, 0.0, total)


def grouped(x, weights, ids, w1, w3, w2, *, swiglu_limit, act_quant_sim, act_quant_block):
    n, k = ids.shape
    E, dt = w1.weight.shape[0], x.dtype
    pw = merged_pair_weights(weights, ids)
    order_in_row = jnp.argsort(ids, axis=-1, stable=True)                 # ascending experts per token
    ids = jnp.take_along_axis(ids, order_in_row, axis=-1).reshape(-1)
    pw = jnp.take_along_axis(pw, order_in_row, axis=-1).reshape(-1)
    order = jnp.argsort(ids, stable=True)
    sizes = jnp.bincount(ids, length=E).astype(jnp.int32)
    xq = quant.fp8_e4m3_sim(x, act_quant_block) if act_quant_sim else x
    rows = jnp.repeat(xq, k, axis=0)[order]

    def mm(a, lin):
        rhs = jnp.swapaxes(dequant_weight(lin.weight, lin.scale, lin.fmt, lin.block), 1, 2).astype(dt)
        if jax.default_backend() == "cpu" and dt != jnp.float32:   # no bf16 x bf16 -> f32 dot on XLA:CPU
            a, rhs = a.astype(jnp.float32), rhs.astype(jnp.float32)
        prec = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
        return jax.lax.ragged_dot(a, rhs, sizes, preferred_element_type=jnp.float32, precision=prec)

    g = round_to(mm(rows, w1), dt).astype(jnp.float32)
    u = round_to(mm(rows, w3), dt).astype(jnp.float32)
    h = round_to(_moe.swiglu(g, u, swiglu_limit) * pw[order][:, None], dt)
    if act_quant_sim:
        h = quant.fp8_e4m3_sim(h, act_quant_block)
    y_sorted = round_to(mm(h, w2), dt)
    y = jnp.zeros_like(y_sorted).at[order].set(y_sorted)
    return sum_in_order(y.reshape(n, k, -1).astype(jnp.float32), axis=1)


def moe_gemm(x, weights, ids, w1, w3, w2, **opts):
    if ids.size < w1.weight.shape[0]:
        return gathered(x, weights, ids, w1, w3, w2, **opts)
    return grouped(x, weights, ids, w1, w3, w2, **opts)
