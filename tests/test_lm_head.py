"""The LM head (`dsjax.layers.lm_head`): its exact bf16 split, its accuracy against a float64 reference, the
method "auto" picks, and the roundings surviving XLA's optimiser."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.layers.lm_head import SPLIT_MAX_ROWS, lm_head, split_bf16x3


def test_bf16x3_head_splits_exactly_and_sums_within_fp32_rounding(test_seed):
    """The LM head's split is exact (hi + mid + lo == y for fp32 values over a wide exponent range), and its
    logits are as close to a float64 reference as the fp32 dot's own (products exact; only fp32 sums differ)."""
    rng = np.random.default_rng(test_seed)
    y = (rng.standard_normal(100_000) * 2.0 ** rng.integers(-60, 60, 100_000)).astype(np.float32)
    parts = np.asarray(split_bf16x3(jnp.asarray(y)).astype(jnp.float32), np.float64)
    np.testing.assert_array_equal(parts[0] + parts[1] + parts[2], y.astype(np.float64))

    keys = jax.random.split(jax.random.key(test_seed), 2)
    y = jax.random.normal(keys[0], (6, 64), jnp.float32) * 3.0
    w = (jax.random.normal(keys[1], (512, 64), jnp.float32) * 0.02).astype(jnp.bfloat16)
    ref = np.asarray(y, np.float64) @ np.asarray(w.astype(jnp.float32), np.float64).T
    err = lambda f: np.abs(np.asarray(f(y, w), np.float64) - ref).max() / np.abs(ref).max()  # noqa: E731
    # measured over 10 seeds: fp32 dot ≤ 3.3e-7, bf16x3 ≤ 1.6e-7; without the lo part ≥ 1.9e-6 (the check can fail)
    split, dot = (functools.partial(lm_head, method=m) for m in ("bf16x3", "fp32"))
    assert err(split) <= 6e-7 and err(dot) <= 6e-7, (err(split), err(dot))
    assert err(lm_head) == err(split)                                   # "auto" at 6 rows of a bf16 weight
    # the roundings survive XLA's optimiser (a plain f32 -> bf16 -> f32 round trip may be dropped on the GPU)
    hlo = jax.jit(split_bf16x3).lower(y).compile().as_text()
    assert hlo.count("reduce-precision(") == 2, hlo


def test_auto_keeps_the_fp32_dot_for_one_row_many_rows_and_fp32_weights():
    """One row (the dot is a copy-rate reduce), prefill-sized row counts (the split's temporary grows 3x) and
    fp32 weights (the split would round them) keep the fp32 dot: bit-identical to method="fp32"."""
    keys = jax.random.split(jax.random.key(0), 3)
    w = jax.random.normal(keys[0], (64, 32), jnp.float32)
    for rows, weight in ((1, w.astype(jnp.bfloat16)), (SPLIT_MAX_ROWS + 1, w.astype(jnp.bfloat16)), (6, w)):
        y = jax.random.normal(keys[1], (rows, 32), jnp.float32)
        np.testing.assert_array_equal(np.asarray(lm_head(y, weight)), np.asarray(lm_head(y, weight, "fp32")))
    with pytest.raises(ValueError, match="bf16x3"):
        lm_head(jnp.ones((2, 32)), w, "bf16x3")
