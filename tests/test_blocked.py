"""`layers.blocked.map_in_blocks`: blocked (ragged last block included) equals one piece, whatever the
block and wherever the mapped axis lands in the output."""

import numpy as np
import pytest

import jax.numpy as jnp

from dsjax.layers.blocked import map_in_blocks


@pytest.mark.parametrize("block", [1, 3, 7, 10, 64])
def test_blocks_equal_one_piece(block, test_seed):
    rng = np.random.default_rng(test_seed)
    a = jnp.asarray(rng.integers(-99, 99, (2, 10, 5)), jnp.int32)       # mapped axis 1 (length 10); integers:
    b = jnp.asarray(rng.integers(-99, 99, (2, 10)), jnp.int32)          # exact whatever XLA's shape-dependent
    w = jnp.asarray(rng.integers(-99, 99, (5, 3)), jnp.int32)           # float orders, so equality is the check

    def fn(a, b):                                  # [2, t, 5], [2, t] -> [2, 3, t]: the mapped axis moves to 2
        return jnp.moveaxis((a @ w) * b[..., None], 1, 2)

    whole = fn(a, b)
    got = map_in_blocks(fn, (a, b), axis=1, block=block, out_axis=2)
    assert got.shape == whole.shape == (2, 3, 10)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(whole))
