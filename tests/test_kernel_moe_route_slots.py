"""dsjax.kernels.moe_gemm.route_slots: routing -> the Mosaic FP4 op's tile slots in one Triton program (interpret
mode) against the XLA form (`pallas_triton.expert_pairs` and masks), and the XLA form against a plain reading of
the contract: every live pair in exactly one slot of a tile of its expert, in each token's ascending-expert order."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.kernels.moe_gemm.route_slots import ROUTE_PAIRS, route_slots, route_slots_xla
from dsjax.kernels.moe_gemm.xla import merged_pair_weights

E, D, I = 16, 256, 128


def _routing(seed, n, k=6):
    """ids with experts shared across tokens, a repeated pick in a token (weights summed on the first), picks of
    another shard (weight 0) and, when n > 1, a token with no live pick."""
    ks = jax.random.split(jax.random.key(seed), 3)
    ids = jax.random.randint(ks[0], (n, k), 0, E // 2 if n > 1 else E)
    w = jax.random.uniform(ks[1], (n, k), jnp.float32, 0.05, 1.0)
    ids = ids.at[0, 1].set(ids[0, 4])                                    # a repeat inside token 0
    w = jnp.where(jax.random.uniform(ks[2], (n, k)) < 0.2, 0.0, w)       # picks held by another shard
    if n > 1:
        w = w.at[n - 1].set(0.0)                                         # a token routed to no local expert
    return w, ids.astype(jnp.int32)


def _check_kernel_equals_xla_form(got, want, pairs):
    for name in ("experts", "slot_of", "found"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), err_msg=name)
    slots = got.experts.shape[0] * pairs          # the flat offsets: the kernel's one longer (its spare element)
    for name in ("x_offset", "h_offset"):
        assert getattr(want, name).shape == (slots,) and getattr(got, name).shape == (slots + 1,), name
        np.testing.assert_array_equal(np.asarray(getattr(got, name))[:slots], np.asarray(getattr(want, name)),
                                      err_msg=name)
    # the kernels' 16-byte expert rows: [expert, 0, 0, 0] a tile; the kernel's one row longer (its spare row)
    T = got.experts.shape[0]
    assert got.head.shape == (T + 1, 4) and want.head.shape == (T, 4)
    assert got.head.dtype == want.head.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got.head)[:T], np.asarray(want.head), err_msg="head")
    np.testing.assert_array_equal(np.asarray(want.head)[:, 0], np.asarray(want.experts), err_msg="head's experts")
    assert not np.asarray(want.head)[:, 1:].any()
    # merged repeats: the same fp32 terms summed, maybe in another order (route's top-k never repeats)
    np.testing.assert_allclose(np.asarray(got.pair_weight), np.asarray(want.pair_weight), rtol=2.0 ** -22)


@pytest.mark.parametrize("n,pairs", [(1, 8), (3, 8), (8, 8), (8, 16), (10, 24)])
def test_kernel_equals_xla_form(test_seed, n, pairs):
    w, ids = _routing(test_seed, n)
    _check_kernel_equals_xla_form(route_slots(w, ids, E, pairs, D, I, interpret=True, head=True),
                                  route_slots_xla(w, ids, E, pairs, D, I, head=True), pairs)
    assert route_slots(w, ids, E, pairs, D, I, interpret=True).head is None    # the rows only where asked
    assert route_slots_xla(w, ids, E, pairs, D, I).head is None


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiled kernels run only on an NVIDIA GPU")
@pytest.mark.parametrize("warps", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("n,pairs", [(1, 8), (8, 8), (10, 24)])
def test_compiled_kernel_equals_xla_form_on_gpu(test_seed, n, pairs, warps):
    """Compiled, with each warp count the op may ask for (`moe_gemm(..., route_warps=)`)."""
    w, ids = _routing(test_seed, n)
    _check_kernel_equals_xla_form(route_slots(w, ids, E, pairs, D, I, interpret=False, warps=warps, head=True),
                                  route_slots_xla(w, ids, E, pairs, D, I, head=True), pairs)


@pytest.mark.parametrize("n,pairs", [(1, 8), (8, 8), (10, 24), (60, 8)])
def test_xla_form_holds_every_live_pair_once(test_seed, n, pairs):
    """Pair p = token t's picks in ascending expert order; a live pair is the first pick of an expert whose merged
    weight (`xla.merged_pair_weights`: the fp32 sums the op defines) is not 0."""
    w, ids = _routing(test_seed, n)
    sl = jax.tree.map(np.asarray, route_slots_xla(w, ids, E, pairs, D, I))
    sl = sl._replace(x_offset=sl.x_offset.reshape(-1, pairs), h_offset=sl.h_offset.reshape(-1, pairs))
    merged = np.asarray(merged_pair_weights(w, ids))
    k = ids.shape[1]
    for t in range(n):
        picks = list(np.asarray(ids[t]))
        in_order = sorted(picks)
        seen = set()
        for place, e in enumerate(in_order):
            p, weight = t * k + place, merged[t, picks.index(e)]
            is_live = place == in_order.index(e) and weight != 0
            assert sl.found[p] == is_live, (t, p)
            if not is_live:
                continue
            tile, slot = divmod(int(sl.slot_of[p]), pairs)
            assert sl.experts[tile] == e and sl.x_offset[tile, slot] == t * D
            assert sl.h_offset[tile, slot] == tile * I * pairs + slot
            assert sl.pair_weight[tile, slot] == weight
            seen.add((tile, slot))
        assert len(seen) == len({e for j, e in enumerate(picks) if merged[t, j] != 0})
    used = sl.x_offset >= 0
    assert used.sum() == sl.found.sum()                                   # no other slot is filled
    assert (sl.pair_weight[~used] == 0).all() and (sl.h_offset[~used] == -1).all()
    assert ((sl.experts >= 0) == used.any(axis=1)).all()


def test_refuses_more_pairs_than_a_program_maps_and_odd_warps():
    w, ids = _routing(0, ROUTE_PAIRS // 6 + 1)
    with pytest.raises(ValueError, match="at most"):
        route_slots(w, ids, E, 8, D, I, interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        route_slots(*_routing(0, 2), E, 8, D, I, interpret=True, warps=6)
