"""Scratch: route_slots_xla with fewer dependent reduction levels (pick space)."""
import jax, jax.numpy as jnp
from dsjax.kernels.moe_gemm.route_slots import Slots


def route_slots_v2(weights, ids, n_experts, pairs, D, I, interpret=None):
    n, k = ids.shape
    P, N, E = n * k, pairs, n_experts
    j = jnp.arange(k, dtype=jnp.int32)
    a_ids, b_ids = ids[:, :, None], ids[:, None, :]                   # [n, a, b]
    same = a_ids == b_ids
    b_before = j[None, None, :] < j[None, :, None]
    # L1: per token: merged weight, first occurrence, place in ascending-expert order (one [n, k, k] level)
    total = jnp.sum(jnp.where(same, weights[:, None, :], 0.0), axis=-1)
    counts = jnp.sum(jnp.stack([(same & b_before), (b_ids < a_ids) | (same & b_before)], -1).astype(jnp.int32),
                     axis=2)
    earlier, place = counts[..., 0] > 0, counts[..., 1]
    pw = jnp.where(earlier, 0.0, total).reshape(-1)                   # by pick a
    key = jnp.where(pw != 0, ids.reshape(-1), E)
    tok = jnp.repeat(jnp.arange(n, dtype=jnp.int32), k)
    p = tok * k + place.reshape(-1)                                   # each pick's pair
    # L2: [P, P] ranks by (key, pair)
    kb, ka = key[None, :], key[:, None]
    sm = kb == ka
    c = jnp.sum(jnp.stack([kb < ka, sm & (p[None, :] < p[:, None]), sm], -1).astype(jnp.int32), axis=1)
    less, rank, end = c[:, 0], c[:, 0] + c[:, 1], c[:, 0] + c[:, 2]
    within = rank - less
    slot = within % N
    valid = key < E
    # L3: each pick's tile (its head's pair) and, per (tile, slot), the pick in it
    head = sm & (within[None, :] == (within - slot)[:, None])
    tile = jnp.sum(jnp.where(head, p[None, :], 0), axis=1)
    at = jnp.where(valid, tile * N + slot, -1)                        # each pick's slot
    cell = jnp.arange(P * N, dtype=jnp.int32)
    hit = at[None, :] == cell[:, None]                                # [P x N, P]
    filled = hit.any(axis=1)
    x_off = jnp.where(filled, jnp.sum(jnp.where(hit, tok[None, :] * D, 0), axis=1), -1)
    pwt = jnp.sum(jnp.where(hit, pw[None, :], 0.0), axis=1)
    h_off = jnp.where(filled, (cell // N) * (I * N) + cell % N, -1)
    starts = valid & (slot == 0)
    experts = jnp.full((P,), -1, jnp.int32).at[jnp.where(starts, p, P)].set(key, mode="drop")
    # slot_of, found in pair order
    byp = p[None, :] == jnp.arange(P, dtype=jnp.int32)[:, None]
    slot_of = jnp.sum(jnp.where(byp, jnp.maximum(at, 0)[None, :], 0), axis=1)
    found = jnp.any(byp & valid[None, :], axis=1)
    return Slots(experts, x_off, h_off, pwt.reshape(P, N), slot_of, found)
