"""dsjax.layers.radix_topk: the sort-free top-k of bf16-valued scores equals `lax.top_k` exactly — values,
indices and their order — on rows full of ties, both zeros (-0 orders below +0, as in lax.top_k), -inf and every
k from 1 to N; and the model's select_topk routes through it only for bf16 values on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.layers import csa2, indexer, radix_topk


def _scores(rng, shape, levels):
    v = rng.integers(-levels, levels, shape).astype(np.float32) / 8      # few distinct values: ties everywhere
    v[..., ::7] = -np.inf
    v[..., 1::11] = -0.0
    v[..., 2::13] = 0.0
    return jnp.asarray(v).astype(jnp.bfloat16).astype(jnp.float32)


@pytest.mark.parametrize("shape,k,levels", [((3, 700), 50, 16), ((2, 5, 4096), 512, 1000), ((4, 2000), 2000, 7),
                                            ((1, 300), 1, 3), ((2, 1024), 1000, 40000)])
def test_equals_lax_top_k(test_seed, shape, k, levels):
    s = _scores(np.random.default_rng(test_seed), shape, levels)
    want = jax.lax.top_k(s, k)
    got = jax.jit(radix_topk.top_k_bf16, static_argnums=1)(s, k)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("opts", [dict(bits_per_pass=4, narrow=False), dict(bits_per_pass=2, narrow=True),
                                  dict(bits_per_pass=8, one_prefix_sum=True, narrow=False),
                                  dict(narrow=True, one_prefix_sum=True), dict(narrow=False)],
                         ids=["4bits-i32", "2bits-u16", "8bits-1sum-i32", "u16-1sum", "i32"])
def test_options_change_nothing(test_seed, opts):
    """The work-saving options (to be timed on the GPU) give the same result: a threshold that falls inside a run
    of ties, k = 1 and k = N, -0/+0 and -inf."""
    rng = np.random.default_rng(test_seed)
    for shape, k, levels in (((3, 700), 50, 16), ((2, 1024), 1000, 40000), ((1, 300), 1, 3), ((4, 257), 257, 5)):
        s = _scores(rng, shape, levels)
        want = jax.lax.top_k(s, k)
        got = jax.jit(lambda s: radix_topk.top_k_bf16(s, k, **opts))(s)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"{shape} k={k}")


def test_kth_key_refuses_uneven_passes():
    with pytest.raises(ValueError, match="bits_per_pass"):
        radix_topk.kth_key(jnp.zeros((1, 4), jnp.int32), 1, bits_per_pass=3)


def test_sort_keys_order_as_values(test_seed):
    """Every bf16 bit pattern but NaN: keys ascend exactly as fp32's total order (lax.sort) ascends."""
    # Built in total order from the bit patterns, not by np.sort: numpy's SIMD sort treats -0 and +0 as equal and
    # may write either (numpy 2.5 with AVX2 returned -0 twice), so the fixture itself would not hold the order.
    negative = np.arange(0xFFFF, 0x7FFF, -1, dtype=np.uint32)  # -NaNs, -inf .. -0: larger bits, more negative
    positive = np.arange(0, 0x8000, dtype=np.uint32)             # +0 .. +inf, +NaNs
    vals = (np.concatenate([negative, positive]) << 16).view(np.float32)
    vals = vals[~np.isnan(vals)]
    assert np.all(np.diff(vals[np.isfinite(vals)]) >= 0) and np.signbit(vals[vals == 0]).tolist() == [True, False]
    keys = np.asarray(radix_topk.sort_keys(jnp.asarray(vals)))
    assert np.all(np.diff(keys) > 0) and keys.min() >= 0 and keys.max() < 1 << 16


def test_refuses_k_out_of_range():
    with pytest.raises(ValueError, match="k must be in 1..8"):
        radix_topk.top_k_bf16(jnp.zeros((2, 8)), 9)


@pytest.mark.parametrize("select", [indexer.select_topk, csa2.select_topk], ids=["v4", "v41"])
def test_select_topk_routes_on_gpu_only(monkeypatch, test_seed, select):
    rng = np.random.default_rng(test_seed)
    s = _scores(rng, (2, 3, 600), 30)
    visible = jnp.arange(600) < jnp.array([[600], [450], [5]])[None]
    want = select(s, visible, 64)
    calls = []
    real = radix_topk.top_k_bf16
    monkeypatch.setattr(radix_topk, "top_k_bf16", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(radix_topk, "RADIX_MIN_ENTRIES", 512)
    select(s, visible, 64, bf16_values=True)
    assert not calls                                             # CPU: lax.top_k
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    select(s, visible, 64)
    assert not calls                                             # not bf16 values: lax.top_k
    got = select(s, visible, 64, bf16_values=True)
    assert calls
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
