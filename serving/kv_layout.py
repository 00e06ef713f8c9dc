"""A conversation's KV as bytes: one batch row of the decode state at a token boundary (window rings, compressor
partial groups, compressed KV and index-key entries, the MTP ring when drafting, the length).

Rows have fixed shapes (max_seq), but only the valid prefix of each compressed cache means anything: entry j of
a ratio-r cache is valid once the length reaches (j+1)·r. So a snapshot ships each `entries` leaf trimmed to
floor(n / r) rows and everything else whole; the importer zero-fills the rest. The MTP ring (`.mtp`, kept by
speculative servers) is draft-only state and is not shipped: an importer that drafts starts it empty (its drafts
are weaker for a while, its tokens are verified and unchanged), so plain and speculative servers share KV. Leaves are raw little-endian
bytes in a fixed order — no pickle — and a compat hash over the model, the weights and this layout makes a
server refuse bytes another layout wrote.
"""

from __future__ import annotations

import dataclasses
import hashlib

import jax
import numpy as np

FORMAT = "dsjax-kv-1"


@dataclasses.dataclass(frozen=True)
class Leaf:
    path: str
    dtype: np.dtype
    shape: tuple[int, ...]   # of the row, leading dimension 1
    ratio: int               # > 0: compressed entries (rows along axis 1); 0: shipped whole
    shipped: bool = True     # False: draft-only state (the MTP ring), zero-filled on import

    def rows(self, n_tokens: int) -> int:
        if not self.shipped:
            return 0
        return min(n_tokens // self.ratio, self.shape[1]) if self.ratio else self.shape[1]

    def nbytes(self, n_tokens: int) -> int:
        per_row = int(np.prod(self.shape[2:], dtype=np.int64)) * self.dtype.itemsize
        if not self.shipped:
            return 0
        return per_row * self.rows(n_tokens) if self.ratio else int(np.prod(self.shape)) * self.dtype.itemsize


class Layout:
    """The byte layout of one engine's state rows. `row_template`: a row pytree (e.g. `take_row` output or its
    `jax.eval_shape`); `identity`: what else must match for bytes to be importable (model config, weights)."""

    def __init__(self, row_template, max_seq: int, identity: str):
        flat, self.treedef = jax.tree_util.tree_flatten_with_path(row_template)
        self.leaves = []
        for path, a in flat:
            name = jax.tree_util.keystr(path)
            ratio = max_seq // a.shape[1] if name.endswith(".entries") else 0
            self.leaves.append(Leaf(name, np.dtype(a.dtype), tuple(a.shape), ratio, not name.startswith(".mtp")))
        spec = repr((FORMAT, identity, max_seq, [(l.path, str(l.dtype), l.shape, l.ratio) for l in self.leaves
                                                 if l.shipped]))
        self.compat = hashlib.sha256(spec.encode()).hexdigest()[:32]

    def nbytes(self, n_tokens: int) -> int:
        return sum(leaf.nbytes(n_tokens) for leaf in self.leaves)

    def pack(self, row, n_tokens: int) -> list[np.ndarray]:
        """Host numpy pieces (uint8, in order) of a row holding n_tokens."""
        out = []
        for leaf, a in zip(self.leaves, jax.tree.leaves(row)):
            if not leaf.shipped:
                continue
            a = np.asarray(a)
            if leaf.ratio:
                a = a[:, :leaf.rows(n_tokens)]
            out.append(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
        return out

    def unpack(self, data, n_tokens: int):
        """A row pytree of numpy arrays from `pack`'s bytes (concatenated); trimmed caches zero-filled."""
        data = memoryview(data)
        if len(data) != self.nbytes(n_tokens):
            raise ValueError(f"KV snapshot has {len(data)} bytes; {n_tokens} tokens in this layout need "
                             f"{self.nbytes(n_tokens)}")
        leaves, at = [], 0
        for leaf in self.leaves:
            n = leaf.nbytes(n_tokens)
            part = np.frombuffer(data[at:at + n], dtype=leaf.dtype)
            at += n
            if leaf.ratio or not leaf.shipped:
                full = np.zeros(leaf.shape, leaf.dtype)
                full[:, :leaf.rows(n_tokens)] = part.reshape((1, leaf.rows(n_tokens)) + leaf.shape[2:])
                part = full
            leaves.append(part.reshape(leaf.shape))
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


def digest(pieces) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for p in pieces:
        h.update(memoryview(p))
    return h.digest()


def token_digest(tokens) -> str:
    return hashlib.blake2b(np.asarray(tokens, np.int32).tobytes(), digest_size=16).hexdigest()
