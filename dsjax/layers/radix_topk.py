"""The exact top-k of bf16-valued scores without a sort over the row: `lax.top_k`'s result, order and ties included.

The indexer's scores are bf16 values (held in fp32, -inf where masked), so each maps to a 16-bit key that orders
as the values do (fp32's total order: -0 below +0, as `lax.top_k` orders them). The k-th largest key τ is found
by a binary search over the 16 bits, one fused compare-and-count pass over the row a bit; the keys above τ and
the first (in index order) of those equal to τ make exactly k, compacted in index order by a prefix sum and one
scatter; a top-k over those k values then puts them in `lax.top_k`'s order (descending, ties to the lower index,
which the compaction's index order gives). A prefill chunk's rows are 64k-1M entries with k = 512, where
`lax.top_k` sorts: on the H200, 1,024 rows of 131,072 entries take 8.5 ms that way and 3.7 ms this way with
uint16 keys (4.9 ms with int32 keys; 65,536: 4.5, 2.0 and 2.6 ms), with the same indices (docs/benchmarks.md).
On CPU it is slower (5x at 64 rows): `top_k` takes it only on a GPU and for rows of at least `RADIX_MIN_ENTRIES`.
Memory: a few int32 arrays of the scores' size (two prefix sums, the pick slots; the keys are uint16): 2 GiB each
for 1,024 rows of 512k entries.
"""

import jax
import jax.numpy as jnp

KEY_BITS = 16
RADIX_MIN_ENTRIES = 65536      # the shortest rows timed (1.7x there); decode-sized rows keep lax.top_k


def top_k(scores, k: int, *, bf16_values: bool):
    """`lax.top_k(scores, k)`; through `top_k_bf16` where it was measured faster (a GPU, rows of at least
    RADIX_MIN_ENTRIES) and the scores are bf16 values (`bf16_values`: the caller's compute dtype is bf16)."""
    if bf16_values and scores.shape[-1] >= RADIX_MIN_ENTRIES and jax.default_backend() == "gpu":
        return top_k_bf16(scores, k)
    return jax.lax.top_k(scores, k)


def sort_keys(scores):
    """fp32 holding bf16 values -> int32 keys in [0, 2^16) ordered as fp32's total order orders the values."""
    bits = jax.lax.bitcast_convert_type(scores.astype(jnp.float32), jnp.uint32) >> 16
    bits = bits.astype(jnp.int32)
    return jnp.where(bits >= 0x8000, 0xFFFF - bits, bits + 0x8000)


def kth_key(keys, k: int, *, bits_per_pass: int = 1):
    """The k-th largest key of each row (with multiplicity): the largest c with count(keys >= c) >= k, found
    `bits_per_pass` bits at a time — one pass counts the keys at or above each of the 2^b - 1 next thresholds
    (fewer passes over the row, more compares a pass). keys: int32 or uint16 (`narrow`: half the bytes a pass)."""
    if bits_per_pass not in (1, 2, 4, 8):
        raise ValueError(f"kth_key: bits_per_pass must divide {KEY_BITS} (1, 2, 4 or 8), got {bits_per_pass}")
    steps = jnp.arange(1, 1 << bits_per_pass, dtype=jnp.int32)

    def step(i, tau):
        shift = KEY_BITS - bits_per_pass * (i + 1)
        cands = tau[..., None] | (steps << shift)                                   # [..., 2^b - 1] ascending
        counts = jnp.sum(keys[..., None, :] >= cands[..., None].astype(keys.dtype), axis=-1, dtype=jnp.int32)
        return tau | (jnp.sum(counts >= k, axis=-1, dtype=jnp.int32) << shift)    # counts fall as c rises

    return jax.lax.fori_loop(0, KEY_BITS // bits_per_pass, step, jnp.zeros(keys.shape[:-1], jnp.int32))


def top_k_bf16(scores, k: int, *, bits_per_pass: int = 1, narrow: bool = True, one_prefix_sum: bool = False):
    """(values, int32 indices) [..., k] of scores [..., N] (bf16 values in fp32, k <= N): `lax.top_k(scores, k)`
    exactly, for scores that are bf16 values. The options change the work, never the result. Timed on the H200
    (2026-12-04e): narrow (uint16 keys, the default) 1.3x faster than int32 keys; bits_per_pass (`kth_key`) = 4
    ~10x slower than 1 (15 compares an entry a pass); one_prefix_sum (the keys above the threshold and the ties
    counted in one int32 prefix sum, `above + ties << ⌈log2 k⌉`, where N fits beside k) not yet timed alone."""
    n = scores.shape[-1]
    if not 0 < k <= n:
        raise ValueError(f"top_k_bf16: k must be in 1..{n}, got {k}")
    keys = sort_keys(scores)
    if narrow:
        keys = keys.astype(jnp.uint16)
    tau = kth_key(keys, k, bits_per_pass=bits_per_pass)[..., None].astype(keys.dtype)
    above = keys > tau
    ties = keys == tau
    room = k - jnp.sum(above, axis=-1, keepdims=True, dtype=jnp.int32)     # >= 1 ties to take, lowest index first
    low = max(1, (k - 1).bit_length())                                      # above's count is < k: `low` bits
    if one_prefix_sum and low + n.bit_length() <= 31:
        both = jnp.cumsum(above.astype(jnp.int32) + (ties.astype(jnp.int32) << low), axis=-1, dtype=jnp.int32)
        above_sum, ties_sum = both & ((1 << low) - 1), both >> low
        take = above | (ties & (ties_sum <= room))
        slot = jnp.where(take, above_sum + jnp.minimum(ties_sum, room) - 1, k)
    else:
        take = above | (ties & (jnp.cumsum(ties, axis=-1, dtype=jnp.int32) <= room))
        slot = jnp.where(take, jnp.cumsum(take, axis=-1, dtype=jnp.int32) - 1, k)   # k: dropped
    lead = scores.shape[:-1]
    flat_slot = slot.reshape(-1, n)
    rows = jnp.arange(flat_slot.shape[0], dtype=jnp.int32)
    picked = jnp.zeros((flat_slot.shape[0], k), jnp.int32).at[rows[:, None], flat_slot].set(
        jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), flat_slot.shape), mode="drop")
    picked = picked.reshape(lead + (k,))                                       # ascending indices
    top, order = jax.lax.top_k(jnp.take_along_axis(scores, picked, axis=-1), k)
    return top, jnp.take_along_axis(picked, order, axis=-1)
