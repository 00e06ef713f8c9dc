"""Engram (V4.1): n-gram hash-table lookups written into the residual stream, gated per hyper-connection copy.

Hashing (spec §3.10). Token ids map onto a compressed vocabulary (tokens that normalise alike share an id; the
map comes from the real tokenizer and must have exactly `engram_compressed_vocab_size` entries, else every hash
moves). Position p of layer L combines the compressed ids c_k of tokens p-k (k < max_ngram; `engram_pad_id`'s id
before the sequence start) as P_k = c_k · mult[L][k] (int64), h_n = P_0 ⊕ … ⊕ P_{n-1}, and each (n, head j)
row id is h_n mod prime[L][n][j] + offset[L][n][j].

The products are int64, but the device keeps no int64: P_k is a host table (two uint32 words per token id and
(layer, k)), XOR works word by word, and `h mod p` runs Horner's rule over the 8 bytes of h in uint32 — exact
while p < 2^24 (r·256 + 255 < 2^32), which the released primes (~1.6·10^7) satisfy. The history a decode step
needs is the last max_ngram-1 token ids (the pad id before the start), kept in the decode state.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsjax import quant
from dsjax.config import ModelConfig
from dsjax.errors import ConfigError
from dsjax.layers.linear import linear
from dsjax.numerics import materialize, mean_exact, round_to, sigmoid

_SENTINEL = "\ue000"  # keeps a token that is exactly one space from collapsing under Strip()


@functools.lru_cache(maxsize=1)
def compressed_token_map() -> tuple[np.ndarray, int]:
    """(int32 map over the tokenizer's 129,280 ids, number of distinct compressed ids), from the real tokenizer.

    Each id is decoded alone with the raw tokenizer and normalised (NFKC, NFD, strip accents, lowercase, collapse
    whitespace, strip — a lone space stays " "); ids whose text holds U+FFFD (partial UTF-8) are keyed by their raw
    token string. Keys get new ids in order of first appearance (spec §3.10 step 1).
    """
    from tokenizers import Regex, normalizers

    from dsjax.tokenizer import load_tokenizer

    backend = load_tokenizer("v4")._hf  # the packaged file, sha256-checked; V4.1 shares its vocabulary
    normalizer = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), _SENTINEL),
        normalizers.Strip(), normalizers.Replace(_SENTINEL, " "),
    ])
    keys: dict[str, int] = {}
    n = backend.get_vocab_size(with_added_tokens=True)
    out = np.empty(n, np.int32)
    for token_id in range(n):
        text = backend.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = backend.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        out[token_id] = keys.setdefault(key, len(keys))
    return out, len(keys)


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    i = 3
    while i * i <= n:
        if n % i == 0:
            return False
        i += 2
    return True


@dataclasses.dataclass(frozen=True)
class EngramConstants:
    """Host-side hash constants of one config (numpy int64), and the tables the device hash uses."""

    token_map: np.ndarray      # int64 [vocab]: compressed id of each model token id
    pad_id: int                # compressed id used before the sequence start
    primes: np.ndarray         # int64 [n_engram_layers, max_ngram-1, n_heads]
    offsets: np.ndarray        # int64 [n_engram_layers, (max_ngram-1)*n_heads], exclusive prefix sums
    multipliers: np.ndarray    # int64 [n_engram_layers, max_ngram]
    products_hi: np.ndarray    # uint32 [n_engram_layers, max_ngram, vocab]: high word of token_map·mult
    products_lo: np.ndarray    # uint32 [n_engram_layers, max_ngram, vocab]: low word


def engram_primes(n_layers: int, max_ngram: int, heads: int, vocab_size: int) -> np.ndarray:
    """int64 [n_layers, max_ngram-1, heads]: per layer, per n-gram size, per head, the next unused prime above
    vocab_size - 1; the search restarts at the base for each n-gram size (spec §3.10 step 3). A layer's table
    has as many rows as its primes sum to."""
    seen: set[int] = set()
    primes = np.zeros((n_layers, max_ngram - 1, heads), np.int64)
    for li in range(n_layers):
        for n in range(max_ngram - 1):
            current = vocab_size - 1
            for j in range(heads):
                current += 1
                while not _is_prime(current) or current in seen:
                    current += 1
                seen.add(current)
                primes[li, n, j] = current
    return primes


@functools.lru_cache(maxsize=8)
def engram_constants(cfg: ModelConfig) -> EngramConstants:
    layers, n_max, heads = cfg.engram_layer_ids, cfg.engram_max_ngram_size, cfg.engram_n_heads
    full_map, size = compressed_token_map()
    if size != cfg.engram_compressed_vocab_size:
        raise ConfigError(f"{cfg.name}: the tokenizer's compressed vocabulary has {size} ids, the config says "
                          f"engram_compressed_vocab_size={cfg.engram_compressed_vocab_size}; every hash would move")
    if cfg.vocab_size > len(full_map):
        raise ConfigError(f"{cfg.name}: vocab_size {cfg.vocab_size} exceeds the tokenizer's {len(full_map)} ids")
    token_map = full_map[: cfg.vocab_size].astype(np.int64)
    primes = engram_primes(len(layers), n_max, heads, cfg.engram_vocab_size)
    if primes.size and primes.max() >= 1 << 24:
        raise ConfigError(f"{cfg.name}: Engram prime {int(primes.max())} ≥ 2^24; the uint32 hash needs smaller primes")
    flat = primes.reshape(len(layers), -1)
    offsets = np.concatenate([np.zeros((len(layers), 1), np.int64), np.cumsum(flat, axis=1)[:, :-1]], axis=1)
    for li, rows in enumerate(cfg.engram_num_embeddings):
        if int(flat[li].sum()) != rows:
            raise ConfigError(f"{cfg.name}: Engram layer {layers[li]}'s primes sum to {int(flat[li].sum())} rows, "
                              f"the config says {rows}")
    bound = max(1, (np.iinfo(np.int64).max // size) // 2)
    mult = np.stack([np.random.default_rng(10007 * layer).integers(0, bound, size=(n_max,), dtype=np.int64) * 2 + 1
                     for layer in layers]) if layers else np.zeros((0, n_max), np.int64)
    prod = token_map[None, None, :] * mult[:, :, None]  # < 2^63 by the bound: no overflow
    return EngramConstants(
        token_map=token_map, pad_id=int(full_map[cfg.engram_pad_id]), primes=primes, offsets=offsets,
        multipliers=mult, products_hi=(prod >> 32).astype(np.uint32), products_lo=(prod & 0xFFFFFFFF).astype(np.uint32))


def hash_ids_reference(cfg: ModelConfig, token_ids: np.ndarray, dead: np.ndarray | None = None) -> np.ndarray:
    """int64 [B, S, n_engram_layers, cols] row ids of a whole sequence from position 0 — numpy, int64, the
    spec's formula as written (the device path `hash_ids` must equal it). `dead` [B, S]: image positions; a
    look-back reads the pad id from the first dead token on."""
    c = engram_constants(cfg)
    comp = c.token_map[np.asarray(token_ids)]
    B, S = comp.shape
    dead = np.zeros((B, S), bool) if dead is None else np.asarray(dead, bool)
    toks, blocked = [], np.zeros((B, S), bool)
    for k in range(cfg.engram_max_ngram_size):
        back = np.concatenate([np.full((B, k), c.pad_id, np.int64), comp[:, : S - k]], axis=1)
        blocked = blocked | np.concatenate([np.zeros((B, k), bool), dead[:, : S - k]], axis=1)
        toks.append(np.where(blocked, c.pad_id, back))
    out = []
    for li in range(len(cfg.engram_layer_ids)):
        rolling, cols = toks[0] * c.multipliers[li, 0], []
        for n in range(1, cfg.engram_max_ngram_size):
            rolling = rolling ^ (toks[n] * c.multipliers[li, n])
            cols.append(rolling[..., None] % c.primes[li, n - 1])
        out.append(np.concatenate(cols, axis=-1) + c.offsets[li])
    return np.stack(out, axis=2)


def _mod_u32(hi, lo, p):
    """(hi·2^32 + lo) mod p for uint32 words and uint32 p < 2^24 (Horner over the 8 bytes)."""
    r = jnp.zeros(jnp.broadcast_shapes(hi.shape, p.shape), jnp.uint32)
    for word in (hi, lo):
        for shift in (24, 16, 8, 0):
            r = (r * jnp.uint32(256) + ((word >> shift) & 0xFF)) % p
    return r


DEAD = -1  # a history entry for a dead token (an image-span position): no n-gram reaches past it


def _with_dead(token_ids, dead):
    return token_ids if dead is None else jnp.where(dead, DEAD, token_ids)


def hash_ids(cfg: ModelConfig, history, token_ids, dead=None):
    """Row ids int32 [B, T, n_engram_layers, cols] of a chunk.

    history int32 [B, max_ngram-1]: the token ids before the chunk, oldest first (`engram_pad_id` before the
    sequence start, `DEAD` for image positions); token_ids int32 [B, T]; dead bool [B, T] or None: image-span
    positions. Looking back from a position, the pad id replaces every token from the first dead one on (the
    position's own included), so no n-gram spans an image (official engram.py, NgramHashState)."""
    c = engram_constants(cfg)
    n_max = cfg.engram_max_ngram_size
    T = token_ids.shape[1]
    ext = jnp.concatenate([history, _with_dead(token_ids, dead)], axis=1)  # [B, n-1+T]
    hi_tab, lo_tab = jnp.asarray(c.products_hi), jnp.asarray(c.products_lo)
    out = []
    for li in range(len(cfg.engram_layer_ids)):
        cols = []
        blocked = jnp.zeros(token_ids.shape, bool)
        for k in range(n_max):
            tok = jax.lax.dynamic_slice_in_dim(ext, n_max - 1 - k, T, axis=1)
            blocked = blocked | (tok == DEAD)
            tok = jnp.where(blocked, cfg.engram_pad_id, tok)
            hi, lo = hi_tab[li, k][tok], lo_tab[li, k][tok]
            if k == 0:
                r_hi, r_lo = hi, lo
                continue
            r_hi, r_lo = r_hi ^ hi, r_lo ^ lo
            primes = jnp.asarray(c.primes[li, k - 1].astype(np.uint32))
            cols.append(_mod_u32(r_hi[..., None], r_lo[..., None], primes).astype(jnp.int32))
        out.append(jnp.concatenate(cols, axis=-1) + jnp.asarray(c.offsets[li].astype(np.int32)))
    return jnp.stack(out, axis=2)


def next_history(history, token_ids, n_valid, dead=None):
    """The last max_ngram-1 token ids after the first n_valid[b] tokens of the chunk (`DEAD` where `dead`)."""
    H = history.shape[1]
    ext = jnp.concatenate([history, _with_dead(token_ids, dead)], axis=1)
    idx = n_valid[:, None] + jnp.arange(H)[None, :]        # positions n_valid .. n_valid+H-1 of ext
    return jnp.take_along_axis(ext, idx, axis=1)


def initial_history(cfg: ModelConfig, batch: int):
    return jnp.full((batch, max(cfg.engram_max_ngram_size - 1, 0)), cfg.engram_pad_id, jnp.int32)


def _dequantised_rows(table, row_ids):
    """table.weight[row_ids] (FP8 codes) times its per-32 e8m0 scales, in fp32: [..., hd]."""
    block = table.weight.shape[-1] // table.scale.shape[-1]
    codes = table.weight[row_ids].astype(jnp.float32)
    scales = quant.e8m0_to_f32(table.scale[row_ids])
    return (codes.reshape(codes.shape[:-1] + (-1, block)) * scales[..., None]).reshape(codes.shape)


def engram_rows(table, row_ids, cfg: ModelConfig):
    """The dequantised Engram rows [B,T,cols,hd] (fp32) of `row_ids` [B,T,cols]. Under a mesh whose
    `engram_rows` axes split the table (2 x ~98 GB in V4.1-Flash), each shard dequantises the rows it holds, zeros
    elsewhere, and one psum (exact: a single non-zero term per row) assembles them — the table is never gathered."""
    from jax.sharding import PartitionSpec as P

    from dsjax.sharding import active_mesh, axis_size, local_ids

    mesh = active_mesh()
    axes = cfg.sharding.mesh_axes("engram_rows")
    if mesh is None or axis_size(mesh, axes) == 1:
        return _dequantised_rows(table, row_ids)

    def local(weight, scale, ids):
        ids, mine = local_ids(ids, axes, weight.shape[0])
        rows = _dequantised_rows(dataclasses.replace(table, weight=weight, scale=scale), ids)
        return jax.lax.psum(jnp.where(mine[..., None], rows, 0.0), axes)

    batch = cfg.sharding.spec(("batch",))
    return jax.shard_map(local, in_specs=(P(axes), P(axes), batch), out_specs=batch,
                         check_vma=False)(table.weight, table.scale, row_ids)


def engram(h, rows, w, cfg: ModelConfig, live=None):
    """h [B,T,n,D] streams, rows [B,T,cols,hd] (`engram_rows` of the token's hash ids) -> h + gate·value
    (spec §3.10), in h's dtype. `live` [B,T] (or None: all): where False (image-span positions) the gate is 0, the
    streams pass through unchanged."""
    B, T, n, D = h.shape
    dt = h.dtype
    kv = linear(rows.astype(dt).reshape(B, T, -1), w.wkv, cfg)                 # [B,T,(n+1)D]
    key = kv[..., : n * D].astype(jnp.float32).reshape(B, T, n, D)
    value = kv[..., n * D:].astype(jnp.float32)
    weight = w.q_weight.astype(jnp.float32) * w.k_weight.astype(jnp.float32)
    hf = h.astype(jnp.float32)
    eps = cfg.norm_eps
    rstd = (jax.lax.rsqrt(mean_exact(hf * hf, axis=-1, keepdims=False) + eps)
            * jax.lax.rsqrt(mean_exact(key * key, axis=-1, keepdims=False) + eps))
    dot = jnp.sum(materialize(hf * weight) * key, axis=-1) * rstd * np.float32(D ** -0.5)
    gate = sigmoid(jnp.copysign(jnp.sqrt(jnp.maximum(jnp.abs(dot), 1e-6)), dot))
    if live is not None:
        gate = jnp.where(live[..., None], gate, 0.0)
    return round_to(hf + materialize(gate[..., None] * value[:, :, None, :]), dt)
