"""MoE: the sparse routed-expert paths against the dense reference, and `route` against the spec in numpy.

routed_experts_sparse has two branches: few rows (n·k < E) gather just the chosen experts' weights; many rows sort
by expert and run one ragged_dot per projection. Both must agree with routed_experts_dense (every expert on every
token, masked), for bf16, FP8 and FP4 expert weights, with and without FP8 activation fake-quant.

What "agree" can mean: the three paths reduce each expert matmul with different XLA kernels (a batched einsum,
a batched mat-vec, ragged_dot), so their fp32 sums may round differently. With random weights and bf16
activations that shows as an occasional one-ulp difference after the bf16 rounding (about 1 element in 1000), in
fp32 compute as last-bit differences nearly everywhere. So the paths are checked in two ways:

* bit for bit on weights and activations built on coarse grids, where every matmul is exact in fp32 whatever the
  summation order (each expert has two live inner units, so each down-projection sums two products; a + b is
  commutative in IEEE). Any routing, gathering, grouping or un-sorting mistake changes these bits;
* on random weights, to a bound far below what such a mistake would cause but above summation-order noise.

route is checked against spec §3.6 written in float64 numpy: score = sqrt(softplus(x·Wᵀ)), the bias added for the
top-k selection only, weights = gathered unbiased scores / their sum × route_scale, hash layers take the ids from
tid2eid; ties go to the lower expert index (what lax.top_k documents and the goldens assume).

The expert paths run op by op (no jit): about 6 s for the whole matrix instead of 2 s per compiled variant; one
case is repeated under jit.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import dsjax
from dsjax import quant
from dsjax.layers.linear import dequantize
from dsjax.layers.moe import route, routed_experts_dense, routed_experts_sparse
from dsjax.params import init_params
from dsjax.weights import Linear, MoE

E, K, D, I = 8, 2, 128, 128
FEW, MANY = 3, 24  # 3·2 = 6 < 8 experts: gathered weights; 24·2 = 48 ≥ 8: ragged_dot
FORMATS = ["bf16", "fp8", "fp4"]


def moe_config(expert_dtype: str, act_quant_sim: bool, numerics: str = "reference-bf16"):
    return dsjax.preset("tiny-v4", vocab_size=256, n_layers=1, compress_ratios=(0, 0), n_hash_layers=1,
                        n_routed_experts=E, n_activated_experts=K, dim=D, moe_inter_dim=I, expert_dtype=expert_dtype
                        ).with_numerics(numerics).replace(act_quant_sim=act_quant_sim)


@functools.lru_cache(maxsize=None)
def random_moes(expert_dtype: str, seed: int) -> tuple[MoE, MoE]:
    """(hash-routed MoE of layer 0, score-routed MoE of the MTP block) with init_params' random weights."""
    p = init_params(moe_config(expert_dtype, False), seed)
    return p.layers[0].ffn, p.mtp[0].block.ffn


GRID_W = np.array([0, 1, 2, 3, 4, 6, 8], np.float32) / 8   # <= 2 significant bits: exact in e4m3, e2m1 (scaled), bf16
GRID_X = np.array([0, 0.5, 1, 1.5, 2], np.float32)


def grid_linear(w: np.ndarray, fmt: str) -> Linear:
    """Stacked [E, out, in] grid values in an expert format; checked to decode back exactly."""
    if fmt == "fp8":
        q, s = quant.quantize_fp8_blocks(w, 128)
        lin = Linear(jnp.asarray(q), jnp.asarray(s), "fp8", 128)
    elif fmt == "fp4":
        q, s = quant.quantize_fp4_packed(w, 32)
        lin = Linear(jnp.asarray(q), jnp.asarray(s), "fp4", 32)
    else:
        lin = Linear(jnp.asarray(w, jnp.bfloat16), None, "bf16", 0)
    np.testing.assert_array_equal(np.asarray(dequantize(lin, jnp.float32)), w)
    return lin


def grid_moe(template: MoE, fmt: str, rng) -> MoE:
    """Experts whose matmuls are exact in any order: grid weights; w1/w3 have two live rows per expert."""
    signs = lambda shape: rng.choice([-1.0, 1.0], shape).astype(np.float32)  # noqa: E731
    w1 = np.zeros((E, I, D), np.float32)
    w3 = np.zeros((E, I, D), np.float32)
    live = rng.permutation(I)[: 2 * E].reshape(E, 2)  # each expert's two live inner units, distinct across experts
    for e in range(E):
        for w in (w1, w3):
            w[e, live[e]] = rng.choice(GRID_W, (2, D)) * signs((2, D))
    w2 = rng.choice(GRID_W, (E, D, I)) * signs((E, D, I))
    return dataclasses.replace(template, w1=grid_linear(w1, fmt), w3=grid_linear(w3, fmt), w2=grid_linear(w2, fmt))


def routings(rng, x, tokens, hashed: MoE, scored: MoE, cfg):
    """name -> (weights fp32 [n, k], ids int32 [n, k]); every row's ids are distinct."""
    n = x.shape[0]
    out = {"score": route(x, tokens, scored, cfg), "hash": route(x, tokens, hashed, cfg)}
    w = rng.uniform(0.1, 1.0, (n, K)).astype(np.float32)
    w = jnp.asarray(w * 1.5 / w.sum(1, keepdims=True))
    out["random"] = (w, jnp.asarray(np.argsort(rng.random((n, E)), axis=1)[:, :K], jnp.int32))
    # only experts 0..3 in use: the ragged groups of experts 4..7 are empty
    out["skewed"] = (w, jnp.asarray(np.argsort(rng.random((n, 4)), axis=1)[:, :K], jnp.int32))
    for name, (_, ids) in out.items():
        assert all(len(set(r)) == K for r in np.asarray(ids).tolist()), f"{name}: duplicate expert in a row"
    return out


def both_paths(x, weights, ids, w, cfg):
    dense = np.asarray(routed_experts_dense(x, weights, ids, w, cfg))
    sparse = np.asarray(routed_experts_sparse(x, weights, ids, w, cfg))
    assert dense.dtype == sparse.dtype == np.float32 and dense.shape == sparse.shape == (x.shape[0], D)
    assert np.isfinite(dense).all() and np.abs(dense).max() > 0
    return dense, sparse


both_paths_jit = jax.jit(lambda x, weights, ids, w, cfg: (routed_experts_dense(x, weights, ids, w, cfg),
                                                          routed_experts_sparse(x, weights, ids, w, cfg)),
                         static_argnums=4)


@pytest.mark.parametrize("n", [FEW, MANY], ids=["gathered", "ragged"])
@pytest.mark.parametrize("act_quant_sim", [False, True], ids=["act-bf16", "act-fp8"])
@pytest.mark.parametrize("expert_dtype", FORMATS)
def test_sparse_equals_dense_bitwise_on_exact_grids(test_seed, expert_dtype, act_quant_sim, n):
    cfg = moe_config(expert_dtype, act_quant_sim)
    hashed, scored = random_moes(expert_dtype, test_seed)
    assert hashed.w1.fmt == expert_dtype and hashed.tid2eid is not None and scored.gate_bias is not None
    rng = np.random.default_rng([test_seed, n, FORMATS.index(expert_dtype), act_quant_sim])
    experts = grid_moe(scored, expert_dtype, rng)
    x = jnp.asarray(rng.choice(GRID_X, (n, D)) * rng.choice([-1, 1], (n, D)), jnp.bfloat16)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, n), jnp.int32)
    for name, (weights, ids) in routings(rng, x, tokens, hashed, scored, cfg).items():
        dense, sparse = both_paths(x, weights, ids, experts, cfg)
        np.testing.assert_array_equal(sparse, dense, err_msg=f"{name} routing, {expert_dtype}, n={n}")
        if expert_dtype == "fp4" and act_quant_sim:  # the configuration the released model runs, compiled
            jd, js = both_paths_jit(x, weights, ids, experts, cfg)
            np.testing.assert_array_equal(np.asarray(js), np.asarray(jd), err_msg=f"jit, {name} routing, n={n}")
            np.testing.assert_array_equal(np.asarray(jd), dense, err_msg=f"jit vs op by op, {name} routing, n={n}")


@pytest.mark.parametrize("n", [FEW, MANY], ids=["gathered", "ragged"])
@pytest.mark.parametrize("act_quant_sim", [False, True], ids=["act-bf16", "act-fp8"])
@pytest.mark.parametrize("expert_dtype", FORMATS)
def test_sparse_matches_dense_on_random_weights(test_seed, expert_dtype, act_quant_sim, n):
    """Random weights: equal up to fp32 summation order. A mis-routed row or expert would be off by O(100%)."""
    cfg = moe_config(expert_dtype, act_quant_sim)
    hashed, scored = random_moes(expert_dtype, test_seed)
    rng = np.random.default_rng([test_seed, n, FORMATS.index(expert_dtype), act_quant_sim, 1])
    x = jnp.asarray(rng.standard_normal((n, D)), jnp.bfloat16)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, n), jnp.int32)
    for name, (weights, ids) in routings(rng, x, tokens, hashed, scored, cfg).items():
        for experts in (scored, hashed):
            dense, sparse = both_paths(x, weights, ids, experts, cfg)
            # Another fp32 summation order can flip one bf16 rounding of g / u / h (or one e4m3 step of h with
            # act-fp8); that moves the expert's y, rounded to bf16 again, by about an ulp of its row, and the K = 2
            # experts add up: within 2^-6 of each token's largest |output| (41 seeds x every case: worst 2^-7.6).
            # Not "mostly bit-identical": one flipped h element moves most of its token's row (a third of the
            # outputs at n = 3; up to 19.5% differed at those seeds).
            row_scale = np.abs(dense).max(axis=1, keepdims=True)
            assert (np.abs(sparse - dense) <= row_scale * 2.0**-6).all(), name


def test_sparse_matches_dense_in_fp32(test_seed):
    """numerics=transformers: fp32 activations, every matmul at HIGHEST precision; only summation order differs."""
    cfg = moe_config("fp4", False, numerics="transformers")
    hashed, scored = random_moes("fp4", test_seed)
    rng = np.random.default_rng([test_seed, 32])
    for n in (FEW, MANY):
        x = jnp.asarray(rng.standard_normal((n, D)), jnp.float32)
        tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, n), jnp.int32)
        for name, (weights, ids) in routings(rng, x, tokens, hashed, scored, cfg).items():
            dense, sparse = both_paths(x, weights, ids, scored, cfg)
            np.testing.assert_allclose(sparse, dense, rtol=0, atol=1e-5 * np.abs(dense).max(), err_msg=f"{name}, n={n}")


@pytest.mark.parametrize("n,branch", [(FEW, False), (MANY, True)])
def test_sparse_branch_is_the_intended_one(test_seed, n, branch):
    cfg = moe_config("fp4", False)
    _, scored = random_moes("fp4", test_seed)
    x = jnp.zeros((n, D), jnp.bfloat16)
    ids = jnp.tile(jnp.arange(K, dtype=jnp.int32), (n, 1))
    jaxpr = str(jax.make_jaxpr(lambda *a: routed_experts_sparse(*a, cfg))(x, jnp.ones((n, K)), ids, scored))
    assert ("ragged_dot" in jaxpr) == branch


# ---------------------------------------------------------------------- route vs the spec (numpy, float64)
def spec_route(x, gate, bias, tid2eid, tokens, k, route_scale):
    """(weights [n, k], ids [n, k], margin [n]); margin is the gap between the k-th and (k+1)-th biased score
    (inf for hash rows), to tell real decisions from float-rounding coin flips."""
    logits = x.astype(np.float64) @ gate.astype(np.float64).T
    scores = np.sqrt(np.logaddexp(0.0, logits))  # softplus = log(1 + e^x)
    if tid2eid is not None:
        ids = tid2eid[tokens]
        margin = np.full(len(x), np.inf)
    else:
        biased = scores + bias
        order = np.argsort(-biased, axis=1, kind="stable")  # equal values: lower index first
        ids = order[:, :k]
        ranked = np.take_along_axis(biased, order, axis=1)
        margin = ranked[:, k - 1] - ranked[:, k]
    w = np.take_along_axis(scores, ids, axis=1)
    return w / w.sum(axis=1, keepdims=True) * route_scale, ids, margin


def route_case(rng, n_experts=16, k=4, d=64, n=256):
    cfg = dsjax.preset("tiny-v4", n_routed_experts=n_experts, n_activated_experts=k)
    x = rng.standard_normal((n, d)).astype(np.float32)
    gate = (rng.standard_normal((n_experts, d)) * (16.0 / d) ** 0.5).astype(np.float32)
    bias = (rng.standard_normal(n_experts) * 0.5).astype(np.float32)
    return cfg, x, gate, bias


def gate_only(gate, bias=None, tid2eid=None) -> MoE:
    return MoE(gate=jnp.asarray(gate), gate_bias=None if bias is None else jnp.asarray(bias),
               tid2eid=None if tid2eid is None else jnp.asarray(tid2eid), w1=None, w2=None, w3=None,
               shared_w1=None, shared_w2=None, shared_w3=None)


def run_route(cfg, x, tokens, moe_w):
    w, ids = route(jnp.asarray(x), jnp.asarray(tokens), moe_w, cfg)
    w, ids = np.asarray(w), np.asarray(ids)
    assert w.dtype == np.float32 and ids.dtype == np.int32
    return w, ids


def dot_error_bound(x, gate):
    """[n, E]: how far an fp32 logit x·g of d terms can lie from the exact one, d·u·Σ|x_i g_i| (u = 2^-24)."""
    return x.shape[1] * 2.0 ** -24 * (np.abs(x.astype(np.float64)) @ np.abs(gate.astype(np.float64)).T)


def decided_rows(margin, x, gate):
    """Rows whose k-th and (k+1)-th biased scores lie further apart than fp32 can move them: a score
    sqrt(softplus(l)) moves by at most half its logit's error (d/dl <= 1/2), plus its own roundings (2^-20). A fixed
    1e-5 margin let a bf16-input row with a closer call through (seed 148 of a 300-seed sweep)."""
    return margin > dot_error_bound(x, gate).max(axis=1) + 2.0 ** -20


def by_expert(ids, w):
    """A row's picks in expert order: which experts and their weights, not top_k's order among near-equal scores
    (two picks 1e-7 apart may come either way in fp32; seed 148 of a 300-seed sweep)."""
    order = np.argsort(ids, axis=1, kind="stable")
    return np.take_along_axis(ids, order, axis=1), np.take_along_axis(w, order, axis=1)


def assert_route_weights(w, ref_w, x, gate, ids, rows=slice(None)):
    """fp32 route weights against the float64 spec, to a bound derived per row rather than a fixed rtol (2e-6 failed
    once in ~10^3 elements: a hash-picked expert with a very negative logit). A weight is sqrt(softplus(l)) over its
    row's sum, and d ln sqrt(softplus(l)) / dl <= 1/2, so its log moves by at most half its own logit's error plus
    half the largest picked one's (through the sum). Plus 16 u for softplus, sqrt, the sum, the divide and the
    scale."""
    rtol = 16 * 2.0 ** -24 + np.take_along_axis(dot_error_bound(x, gate), ids, axis=1).max(axis=1, keepdims=True)
    err = np.abs(w - ref_w)[rows] / np.abs(ref_w)[rows]
    assert (err <= rtol[rows]).all(), f"relative error {err.max():.3g} over the bound {rtol[rows].min():.3g}"


def assert_decided_rows_match_spec(w, ids, ref_w, ref_ids, margin, x, gate):
    """On the rows fp32 cannot reorder at the k-th pick (`decided_rows`): the same experts, in expert order, with
    weights within `assert_route_weights`' bound. Returns the decided rows."""
    decided = decided_rows(margin, x, gate)
    (ids_e, w_e), (ref_ids_e, ref_w_e) = by_expert(ids, w), by_expert(ref_ids, ref_w)
    np.testing.assert_array_equal(ids_e[decided], ref_ids_e[decided])
    assert_route_weights(w_e, ref_w_e, x, gate, ids_e, decided)
    return decided


def test_route_score_layers_match_spec(test_seed):
    rng = np.random.default_rng([test_seed, 41])
    cfg, x, gate, bias = route_case(rng)
    tokens = np.zeros(len(x), np.int32)
    w, ids = run_route(cfg, x, tokens, gate_only(gate, bias))
    ref_w, ref_ids, margin = spec_route(x, gate, bias, None, tokens, cfg.n_activated_experts, cfg.route_scale)
    decided = assert_decided_rows_match_spec(w, ids, ref_w, ref_ids, margin, x, gate)
    assert decided.mean() > 0.95
    np.testing.assert_allclose(w.sum(1), cfg.route_scale, rtol=1e-6)


def test_route_bias_selects_but_does_not_weigh(test_seed):
    """A large bias forces an expert with a small score into every row; its weight still comes from its score."""
    rng = np.random.default_rng([test_seed, 42])
    cfg, x, gate, bias = route_case(rng)
    gate[5] = 0.0
    gate[5, 0] = -4.0   # expert 5's logit is -4·x0: mostly a small score
    bias[5] = 100.0
    tokens = np.zeros(len(x), np.int32)
    w, ids = run_route(cfg, x, tokens, gate_only(gate, bias))
    assert (ids[:, 0] == 5).all()  # top_k returns the largest biased score first
    ref_w, ref_ids, margin = spec_route(x, gate, bias, None, tokens, cfg.n_activated_experts, cfg.route_scale)
    assert_decided_rows_match_spec(w, ids, ref_w, ref_ids, margin, x, gate)
    scores = np.sqrt(np.logaddexp(0.0, x.astype(np.float64) @ gate.astype(np.float64).T))
    chosen = np.take_along_axis(scores, ids, axis=1)
    assert_route_weights(w[:, :1], chosen[:, :1] / chosen.sum(1, keepdims=True) * cfg.route_scale, x, gate, ids)


def test_route_hash_layers_match_spec(test_seed):
    rng = np.random.default_rng([test_seed, 43])
    cfg, x, gate, _ = route_case(rng)
    vocab = 50
    tid2eid = np.argsort(rng.random((vocab, cfg.n_routed_experts)), axis=1)[:, :cfg.n_activated_experts]
    tokens = rng.integers(0, vocab, len(x)).astype(np.int32)
    w, ids = run_route(cfg, x, tokens, gate_only(gate, tid2eid=tid2eid.astype(np.int32)))
    ref_w, ref_ids, _ = spec_route(x, gate, None, tid2eid, tokens, cfg.n_activated_experts, cfg.route_scale)
    np.testing.assert_array_equal(ids, ref_ids)  # the table's order, not sorted
    assert_route_weights(w, ref_w, x, gate, ids)


def test_route_ties_go_to_the_lower_index(test_seed):
    """Exact ties: small-integer activations and gate rows make every logit an exact integer, and duplicated gate
    rows with equal biases make groups of experts tie exactly. The lower index must win, as in a stable sort."""
    rng = np.random.default_rng([test_seed, 44])
    n_experts, k, d, n = 16, 3, 32, 128
    cfg = dsjax.preset("tiny-v4", n_routed_experts=n_experts, n_activated_experts=k)
    x = rng.integers(-2, 3, (n, d)).astype(np.float32)
    rows = rng.permutation(np.repeat(np.arange(3), [5, 5, 6]))  # 3 distinct gate rows shared by 5, 5, 6 experts
    gate = rng.integers(-1, 2, (3, d)).astype(np.float32)[rows]
    bias = (rng.integers(-1, 2, 3) * 0.5).astype(np.float32)[rows]  # equal rows, equal bias
    tokens = np.zeros(n, np.int32)
    w, ids = run_route(cfg, x, tokens, gate_only(gate, bias))
    ref_w, ref_ids, margin = spec_route(x, gate, bias, None, tokens, k, cfg.route_scale)
    assert (margin == 0).all()  # the winning group has >= 5 members for k = 3: the boundary is always a tie
    np.testing.assert_array_equal(ids, ref_ids)
    assert_route_weights(w, ref_w, x, gate, ids)


def test_route_in_bf16_model_input_matches_spec(test_seed):
    """The model hands route bf16 activations; it computes in fp32 from them (spec: x.float() @ gate.float())."""
    rng = np.random.default_rng([test_seed, 45])
    cfg, x, gate, bias = route_case(rng)
    xb = x.astype(ml_dtypes.bfloat16)
    gb = gate.astype(ml_dtypes.bfloat16)
    tokens = np.zeros(len(x), np.int32)
    w, ids = run_route(cfg, xb, tokens, gate_only(gb, bias))
    x32, g32 = xb.astype(np.float32), gb.astype(np.float32)
    ref_w, ref_ids, margin = spec_route(x32, g32, bias, None, tokens, cfg.n_activated_experts, cfg.route_scale)
    assert_decided_rows_match_spec(w, ids, ref_w, ref_ids, margin, x32, g32)
