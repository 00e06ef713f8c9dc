"""Routing [n, k] -> the Mosaic FP4 expert op's tile slots: which expert each tile runs, where each slot's x and h
rows lie, its pair weight, and each pair's slot for the way back.

Why: at decode the op's own kernels take ~170 µs at 8 tokens and its glue 18.6 µs in 11 launches (H200,
2026-12-04, docs/benchmarks.md "The A tiles in one launch"): after the A tiles (`tile_operands`) most of it is
this map — the per-token pick order, merged repeats, the counted tile map, the slot masks and the unsort
compares, ~1 µs a launch. `route_slots` is all of it in one Triton program (up to `ROUTE_PAIRS` pairs: [P, P]
compares in registers), the op's default from 2 tokens (H100, 2026-12-06: the op's kernels 1.3-5% faster at 2-8
tokens; the program itself ~5 µs at 8 tokens whatever its warps); `route_slots_xla` is the same contract in XLA ops
(`pallas_triton.expert_pairs` and the masks): one token's map (its pairs are tiles in place: no compares), the path
above `ROUTE_PAIRS` and the kernel's check.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from dsjax.kernels.common import gather, iota, pow2_ceil, triton_interpret, triton_params

ROUTE_PAIRS = 64     # pairs one program maps ([P, P] compares: 8 tokens of top-6 are 48)
ROUTE_WARPS = 4      # the program's warps
SCATTER_PAIRS = 1024  # above this many pairs the XLA form's unsort is a scatter (the compare matrix is pairs x slots)


class Slots(NamedTuple):
    """The op's per-tile inputs. T tiles of N slots; a tile's pairs are one expert's, in the reference's order."""
    experts: jax.Array      # int32 [T]: the tile's expert, -1 = no tile
    x_offset: jax.Array     # int32 [>= T x N], slot (t, n) at t x N + n: its token row start in x, flat (token x D);
                            # -1 = empty slot. Flat, and from the kernel one longer: `tile_operands` reads it as
                            # stored (a slice would be a copy kernel of its own between two custom calls)
    h_offset: jax.Array     # int32, as x_offset: the slot's column of h [T, I, N], flat (t x I x N + slot)
    pair_weight: jax.Array  # fp32 [T, N]: the slot's routing weight (repeats merged); 0 = empty
    slot_of: jax.Array      # int32 [P]: each pair's slot (t x N + slot), pairs in each token's ascending-expert order
    found: jax.Array        # bool [P]: the pair has a slot (False: weight 0, or a pick of another shard)
    head: jax.Array | None  # int32 [>= T, 4] where asked: `mosaic_fp4.expert_rows(experts)`, the kernels'
                            # 16-byte expert rows; the kernel's one row longer (its spare row): no pad kernel


def route_slots_xla(weights, ids, n_experts: int, pairs: int, D: int, I: int, interpret=None,
                    head: bool = False) -> Slots:
    """`Slots` from `pallas_triton.expert_pairs` (its tile map by size) and XLA masks; the unsort by compares (a
    scatter above `SCATTER_PAIRS`, where the compare matrix would be pairs x slots; none for one token, whose pairs
    are tiles in place). head: the kernels' expert rows too (`expert_rows`: a pad)."""
    from dsjax.kernels.moe_gemm.mosaic_fp4 import expert_rows
    from dsjax.kernels.moe_gemm.pallas_triton import expert_pairs

    del interpret
    n, k = ids.shape
    P = n * k
    _, pw, order, tiles = expert_pairs(weights, ids, n_experts, pairs)
    T = tiles.shape[0]
    slot = jnp.arange(pairs, dtype=jnp.int32)
    pair = tiles[:, 1:2] + slot[None, :]                               # [T, N]: the sorted pair of each slot
    valid = (tiles[:, :1] >= 0) & (pair < tiles[:, 2:3])
    pair = jnp.where(valid, pair, 0)
    original = pair if n == 1 else order[pair]
    pw_sorted = pw if n == 1 else pw[order]
    t_of = jnp.arange(T, dtype=jnp.int32)[:, None]
    slots = jnp.arange(T * pairs, dtype=jnp.int32)
    flat = original.reshape(-1)
    if n == 1:      # one token: pair p is tile p's only slot (`single_token_tiles`), so no compares (one kernel fewer)
        found = tiles[:, 0] >= 0
        slot_of = jnp.where(found, jnp.arange(P, dtype=jnp.int32) * pairs, 0)
    elif P <= SCATTER_PAIRS:
        hit = (flat[None, :] == jnp.arange(P, dtype=jnp.int32)[:, None]) & valid.reshape(-1)[None, :]
        slot_of, found = (hit * slots[None, :]).sum(axis=1), hit.any(axis=1)
    else:
        target = jnp.where(valid.reshape(-1), flat, P)                   # invalid slots: out of bounds, dropped
        slot_of = jnp.full((P,), -1, jnp.int32).at[target].set(slots, mode="drop")   # -1: no slot (one scatter)
        slot_of, found = jnp.maximum(slot_of, 0), slot_of >= 0
    return Slots(tiles[:, 0], jnp.where(valid, original // k * D, -1).reshape(-1),
                 jnp.where(valid, t_of * I * pairs + slot, -1).reshape(-1), jnp.where(valid, pw_sorted[pair], 0.0),
                 slot_of, found, expert_rows(tiles[:, 0]) if head else None)


def route_slots(weights, ids, n_experts: int, pairs: int, D: int, I: int, interpret=None,
                warps: int = ROUTE_WARPS, head: bool = False) -> Slots:
    """`Slots` in one Triton program, tiles indexed by pair (T = P, as the counted map makes them). Each pick
    finds its place in its token's ascending-expert order, its merged weight, its rank among the pairs (by key,
    then place) and so its tile and slot, by compares with every other pick; then every slot is written once —
    by its pair, or as empty by the tile's own row of the map. warps: the program's (its [P, P] work spread).
    head: every tile's 16-byte expert row too (the kernels' head, otherwise a pad kernel of its own: ~1.1 µs at
    every size on an H100, docs/benchmarks.md), one row longer (the spare row)."""
    n, k = ids.shape
    P, N, E = n * k, pairs, n_experts
    if P > ROUTE_PAIRS:
        raise ValueError(f"route_slots: {P} pairs; one program maps at most {ROUTE_PAIRS} (use route_slots_xla)")
    if warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"route_slots: warps must be a power of two from 1 to 32, got {warps!r}")
    Pp, Np = pow2_ceil(P), pow2_ceil(N)

    def body(ids_ref, w_ref, experts_ref, x_ref, h_ref, pw_ref, slot_ref, found_ref, *head_ref):
        a = iota(Pp)
        live = a < P
        pick = jnp.where(live, gather(ids_ref, a, mask=live), E)
        w = gather(w_ref, a, mask=live)
        i, j = a // k, a % k
        col = lambda v: v[None, :]  # noqa: E731  (the other pick of each compare)
        row = col(live) & (i[:, None] == col(i))
        same_pick = row & (pick[:, None] == col(pick))
        total = jnp.sum(jnp.where(same_pick, col(w), 0.0), axis=1)           # repeats summed on the first
        earlier = jnp.max(jnp.where(same_pick & (col(j) < j[:, None]), 1, 0), axis=1) > 0
        pw = jnp.where(earlier, 0.0, total)
        before = row & ((col(pick) < pick[:, None]) | ((col(pick) == pick[:, None]) & (col(j) < j[:, None])))
        p = i * k + jnp.sum(before.astype(jnp.int32), axis=1)               # the pair: token, ascending expert
        key = jnp.where(live & (pw != 0), pick, E)
        same = col(live) & (col(key) == key[:, None])
        less = jnp.sum((col(live) & (col(key) < key[:, None])).astype(jnp.int32), axis=1)
        rank = less + jnp.sum((same & (col(p) < p[:, None])).astype(jnp.int32), axis=1)
        end = less + jnp.sum(same.astype(jnp.int32), axis=1)
        within = rank - less
        slot = within % N
        valid = live & (key < E)
        starts = valid & (slot == 0)
        leader = same & (col(within) == (within - slot)[:, None])            # the pair that starts my tile
        tile = jnp.sum(jnp.where(leader, col(p), 0), axis=1)
        # masked lanes aim at a spare last element: the HLO interpreter writes them back (old values), and two
        # lanes of one store must not meet
        at = jnp.where(valid, tile * N + slot, P * N)
        own = jnp.where(live, p, P)
        tile_expert = jnp.where(starts, key, -1)
        plt.store(experts_ref.at[own], tile_expert)
        if head:                                                             # [expert, 0, 0, 0] a tile
            c = iota(4)[None, :]
            plt.store(head_ref[0].at[own[:, None] * 4 + c], jnp.where(c == 0, tile_expert[:, None], 0))
        plt.store(slot_ref.at[own], jnp.where(valid, at, 0))
        plt.store(found_ref.at[own], valid.astype(jnp.int32))
        plt.store(x_ref.at[at], i * D)
        plt.store(h_ref.at[at], tile * (I * N) + slot)
        plt.store(pw_ref.at[at], pw)
        s = iota(Np)[None, :]
        empty = live[:, None] & (s < N) & ~(starts[:, None] & (rank[:, None] + s < end[:, None]))
        rows = jnp.where(empty, p[:, None] * N + s, P * N)
        plt.store(x_ref.at[rows], jnp.full((Pp, Np), -1, jnp.int32))
        plt.store(h_ref.at[rows], jnp.full((Pp, Np), -1, jnp.int32))
        plt.store(pw_ref.at[rows], jnp.zeros((Pp, Np), jnp.float32))

    i32 = lambda m: jax.ShapeDtypeStruct((m + 1,), jnp.int32)  # noqa: E731  (+1: the spare element)
    experts, x_off, h_off, pw, slot_of, found, *rows = pl.pallas_call(
        body, out_shape=(i32(P), i32(P * N), i32(P * N), jax.ShapeDtypeStruct((P * N + 1,), jnp.float32), i32(P),
                         i32(P), *([jax.ShapeDtypeStruct(((P + 1) * 4,), jnp.int32)] if head else [])),
        grid=(1,), compiler_params=triton_params(warps, 1), interpret=triton_interpret(interpret),
        name="moe_route_slots")(ids.reshape(-1).astype(jnp.int32), weights.reshape(-1).astype(jnp.float32))
    return Slots(experts[:P], x_off, h_off, pw[:P * N].reshape(P, N), slot_of[:P], found[:P] != 0,
                 rows[0].reshape(P + 1, 4) if head else None)
