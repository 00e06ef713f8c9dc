"""Mixture of experts: √softplus scores, top-k (bias steers selection only) or hash routing, SwiGLU experts.

Routing weights are the unbiased scores of the chosen experts, normalised and scaled by `route_scale`, and
applied before the down projection as the reference does. Both gate and up are clamped (`swiglu_limit`) in
routed and shared experts (the current official revision).
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dsjax.config import ModelConfig
from dsjax.kernel_choice import choose
from dsjax.layers.linear import dequantize, einsum_acc32, linear
from dsjax import quant
from dsjax.sharding import active_mesh, axis_size, local_ids
from dsjax.weights import MoE
from dsjax.numerics import div_exact, round_to, sigmoid, silu, softmax_exact, softplus, sum_in_order


def route(x, token_ids, w: MoE, cfg: ModelConfig, image_mask=None):
    """x [n,D] -> (weights fp32 [n,k], expert ids int32 [n,k]). V4.1: tokens where `image_mask` [n] is set (image
    spans) select experts with `gate_bias_vl` instead of `gate_bias` (official model.py, Gate)."""
    logits = jnp.einsum("nd,ed->ne", x.astype(jnp.float32), w.gate.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)
    if cfg.gate_temp != 1.0:
        logits = div_exact(logits, cfg.gate_temp)
    if cfg.score_func == "softmax":
        scores = softmax_exact(logits, axis=-1)
    elif cfg.score_func == "sigmoid":
        scores = sigmoid(logits)
    else:
        scores = jnp.sqrt(softplus(logits))
    if w.tid2eid is not None:
        ids = w.tid2eid[token_ids].astype(jnp.int32)
    else:
        bias = w.gate_bias
        if image_mask is not None and getattr(w, "gate_bias_vl", None) is not None:
            bias = jnp.where(image_mask[:, None], w.gate_bias_vl, w.gate_bias)
        _, ids = jax.lax.top_k(scores + bias, cfg.n_activated_experts)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.score_func != "softmax":
        weights = div_exact(weights, jnp.sum(weights, axis=-1, keepdims=True))
    return weights * cfg.route_scale, ids


def swiglu(gate, up, limit: float, divide=None):
    """silu(min(gate, limit)) · clip(up, ±limit) in fp32 (divide: `numerics.silu`'s)."""
    if limit > 0:
        up = jnp.clip(up, -limit, limit)
        gate = jnp.minimum(gate, limit)
    return silu(gate, divide) * up


def shared_expert(x, w: MoE, cfg: ModelConfig):
    g = linear(x, w.shared_w1, cfg).astype(jnp.float32)
    u = linear(x, w.shared_w3, cfg).astype(jnp.float32)
    return linear(round_to(swiglu(g, u, cfg.swiglu_limit), x.dtype), w.shared_w2, cfg)


def routed_experts_dense(x, weights, ids, w: MoE, cfg: ModelConfig):
    """Every expert on every token, masked by the routing weights (the reference: simple, exact, O(E)).

    `ids` index the experts held in `w` (E = their count: all of them, or one shard's under expert
    parallelism, where non-local picks carry weight 0)."""
    dt = x.dtype
    E = w.w1.weight.shape[0]
    combine = jnp.sum(jax.nn.one_hot(ids, E, dtype=jnp.float32) * weights[..., None], axis=1)  # [n,E]
    xq = quant.fp8_e4m3_sim(x, cfg.act_quant_block) if cfg.act_quant_sim else x
    w1, w3, w2 = (dequantize(m, dt) for m in (w.w1, w.w3, w.w2))
    g = round_to(einsum_acc32("nd,eid->nei", xq, w1), dt).astype(jnp.float32)
    u = round_to(einsum_acc32("nd,eid->nei", xq, w3), dt).astype(jnp.float32)
    h = round_to(swiglu(g, u, cfg.swiglu_limit) * combine[..., None], dt)
    if cfg.act_quant_sim:
        h = quant.fp8_e4m3_sim(h, cfg.act_quant_block)
    y = round_to(einsum_acc32("nei,edi->ned", h, w2), dt)
    return sum_in_order(y.astype(jnp.float32), axis=1)


def _expert_ffn(xs, ws, w: MoE, cfg: ModelConfig, matmul_fn):
    """SwiGLU of each (token, expert) row xs [m, D] with its routing weight ws [m]; returns [m, D] in x's dtype."""
    dt = xs.dtype
    xq = quant.fp8_e4m3_sim(xs, cfg.act_quant_block) if cfg.act_quant_sim else xs
    g = round_to(matmul_fn(xq, w.w1), dt).astype(jnp.float32)
    u = round_to(matmul_fn(xq, w.w3), dt).astype(jnp.float32)
    h = round_to(swiglu(g, u, cfg.swiglu_limit) * ws[:, None], dt)
    if cfg.act_quant_sim:
        h = quant.fp8_e4m3_sim(h, cfg.act_quant_block)
    return round_to(matmul_fn(h, w.w2), dt)


def routed_experts_sparse(x, weights, ids, w: MoE, cfg: ModelConfig):
    """Only the chosen experts: gathered weights for few rows (decode), a grouped matmul otherwise (prefill).

    Per token the k expert outputs are summed in ascending expert order, as the reference's loop does.
    """
    n, k = ids.shape
    E, dt = w.w1.weight.shape[0], x.dtype
    order_in_row = jnp.argsort(ids, axis=-1)
    ids = jnp.take_along_axis(ids, order_in_row, axis=-1)
    weights = jnp.take_along_axis(weights, order_in_row, axis=-1)
    flat_e, flat_w = ids.reshape(-1), weights.reshape(-1)
    xs = jnp.repeat(x, k, axis=0)
    if n * k < E:  # few rows: read just their experts' weights
        def gathered(a, lin):
            sub = type(lin)(lin.weight[flat_e], None if lin.scale is None else lin.scale[flat_e], lin.fmt, lin.block)
            return einsum_acc32("md,mod->mo", a, dequantize(sub, dt))
        y = _expert_ffn(xs, flat_w, w, cfg, gathered)
    else:  # many rows: sort by expert, one grouped matmul per projection
        order = jnp.argsort(flat_e, stable=True)
        sizes = jnp.bincount(flat_e, length=E).astype(jnp.int32)

        def grouped(a, lin):
            rhs = jnp.swapaxes(dequantize(lin, dt), 1, 2)  # [E, in, out]
            if jax.default_backend() == "cpu" and dt != jnp.float32:
                a, rhs = a.astype(jnp.float32), rhs.astype(jnp.float32)
            return jax.lax.ragged_dot(a, rhs, sizes, preferred_element_type=jnp.float32,
                                      precision=jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None)
        y_sorted = _expert_ffn(xs[order], flat_w[order], w, cfg, grouped)
        y = jnp.zeros_like(y_sorted).at[order].set(y_sorted)
    return sum_in_order(y.reshape(n, k, -1).astype(jnp.float32), axis=1)


def routed_experts_kernel(x, weights, ids, w: MoE, cfg: ModelConfig):
    """The routed experts through the Pallas expert-GEMM kernels (`dsjax.kernels.moe_gemm`)."""
    from dsjax.kernels import moe_gemm   # the kernels' reference imports this module
    return moe_gemm.moe_gemm(x, weights, ids, w.w1, w.w3, w.w2, swiglu_limit=cfg.swiglu_limit,
                             act_quant_sim=cfg.act_quant_sim, act_quant_block=cfg.act_quant_block,
                             implementation="pallas")


def routed_experts(x, weights, ids, w: MoE, cfg: ModelConfig):
    """fp32 [n, D] sum of each token's routed experts; expert-parallel under a mesh (`expert_parallel`)."""
    experts = routed_experts_dense if cfg.kernel_mode == "reference" else routed_experts_sparse
    if choose(cfg, "moe_gemm", rows=x.shape[0], dtype=x.dtype, fmt=w.w1.fmt) == "pallas":
        experts = routed_experts_kernel
    if active_mesh() is None:
        return experts(x, weights, ids, w, cfg)
    return expert_parallel(experts, x, weights, ids, w, cfg)


def expert_parallel(experts, x, weights, ids, w: MoE, cfg: ModelConfig):
    """Each device runs its local slice of the experts on every token, picks of other shards masked to weight 0,
    and a psum over the expert axes adds the slices. Tokens sharded over an expert axis (the batch on `dp`
    when experts span dp x tp) are all-gathered first and the sum scattered back."""
    rules = cfg.sharding
    mesh = active_mesh()
    ep = rules.mesh_axes("experts")
    tok = tuple(a for a in rules.mesh_axes("batch") if axis_size(mesh, (a,)) > 1)
    gathered = tuple(a for a in tok if a in ep)
    tok_spec = P(tok or None)
    routed = MoE(gate=None, gate_bias=None, tid2eid=None, w1=w.w1, w2=w.w2, w3=w.w3,
                 shared_w1=None, shared_w2=None, shared_w3=None)
    w_spec = jax.tree.map(lambda a: P(ep), routed)

    def local(x, weights, ids, w):
        for a in gathered:
            x, weights, ids = (jax.lax.all_gather(v, a, tiled=True) for v in (x, weights, ids))
        ids, mine = local_ids(ids, ep, w.w1.weight.shape[0])
        y = experts(x, jnp.where(mine, weights, 0.0), ids, w, cfg)
        summed = tuple(a for a in ep if a not in gathered)
        for a in gathered:
            y = jax.lax.psum_scatter(y, a, scatter_dimension=0, tiled=True)
        return jax.lax.psum(y, summed) if summed else y

    return jax.shard_map(local, in_specs=(tok_spec, tok_spec, tok_spec, w_spec), out_specs=tok_spec,
                         check_vma=False)(x, weights, ids, routed)


def moe(x, token_ids, w: MoE, cfg: ModelConfig, image_mask=None):
    """x [b,s,D], token_ids [b,s] -> [b,s,D]: routed experts (fp32 sum) + shared expert, in x's dtype.
    `image_mask` [b,s] (V4.1): image-span tokens, routed with the VL bias."""
    shape = x.shape
    xf = x.reshape(-1, shape[-1])
    weights, ids = route(xf, token_ids.reshape(-1), w, cfg, None if image_mask is None else image_mask.reshape(-1))
    y = routed_experts(xf, weights, ids, w, cfg)
    y = y + shared_expert(xf, w, cfg).astype(jnp.float32)
    return round_to(y, x.dtype).reshape(shape)

