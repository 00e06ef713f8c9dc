"""The host KV store of one server: conversation snapshots in one pre-allocated arena, by byte budget.

The arena is a single host buffer cut into fixed-size blocks, allocated once at start-up (and registered once
with NIXL when path A is on), so remote readers always see memory that stays mapped. A snapshot takes the blocks
it needs; when the budget is full the least recently used snapshot *without a lease* is dropped. A lease pins a
snapshot: its blocks are never freed or reused while the lease lives (a replaced snapshot is retired and freed
when its last lease ends). Every snapshot gets a fresh generation number, so a reader can tell reused memory
from the bytes it acquired. Thread-safe: the engine thread stores, the KvPeer server reads.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
import uuid

import numpy as np

from dsjax.serving.kv_layout import digest


@dataclasses.dataclass
class Snapshot:
    cid: str
    kind: str                 # "prompt" (end of a turn's prefill) | "final" (end of generation)
    tokens: np.ndarray        # int32: the tokens whose KV this holds
    gen: int
    nbytes: int
    blocks: list[int]
    digest: bytes
    leases: int = 0
    retired: bool = False


@dataclasses.dataclass
class Lease:
    id: str
    snap: Snapshot
    deadline: float


class HostKvStore:
    def __init__(self, budget_bytes: int, block_bytes: int = 1 << 20, lease_ttl_s: float = 30.0):
        n = max(1, budget_bytes // block_bytes)
        self.block = block_bytes
        self.arena = np.zeros(n * block_bytes, np.uint8)
        self.free = list(range(n))
        self.lease_ttl = lease_ttl_s
        self._snaps: collections.OrderedDict[tuple[str, str], Snapshot] = collections.OrderedDict()
        self._leases: dict[str, Lease] = {}
        self._gen = itertools.count(int(time.time() * 1000) << 16)  # unique across restarts of this server
        self._lock = threading.Lock()
        self.evictions = 0

    # ---- writing ----

    def put(self, cid: str, kind: str, tokens, pieces: list[np.ndarray]) -> Snapshot | None:
        """Copy `pieces` (uint8) into the arena as the `kind` snapshot of `cid`; None if even after dropping every
        unleased snapshot it does not fit."""
        nbytes = sum(p.size for p in pieces)
        need = -(-nbytes // self.block)
        with self._lock:
            self._reap()
            while len(self.free) < need and self._evict_one():
                pass
            if len(self.free) < need:
                return None
            blocks = [self.free.pop() for _ in range(need)]
            snap = Snapshot(cid, kind, np.asarray(tokens, np.int32), next(self._gen), nbytes, blocks, digest(pieces))
            old = self._snaps.pop((cid, kind), None)
            if old is not None:
                self._retire(old)
            self._snaps[(cid, kind)] = snap
        self._write(snap, pieces)
        return snap

    def _write(self, snap: Snapshot, pieces) -> None:
        flat = np.concatenate(pieces) if len(pieces) > 1 else pieces[0]
        for i, b in enumerate(snap.blocks):
            part = flat[i * self.block:(i + 1) * self.block]
            self.arena[b * self.block:b * self.block + part.size] = part

    def _retire(self, snap: Snapshot) -> None:
        snap.retired = True
        if not snap.leases:
            self.free.extend(snap.blocks)
            snap.blocks = []

    def _evict_one(self) -> bool:
        for key, snap in self._snaps.items():  # oldest first
            if not snap.leases:
                del self._snaps[key]
                self._retire(snap)
                self.evictions += 1
                return True
        return False

    def drop(self, cid: str) -> None:
        with self._lock:
            for kind in ("prompt", "final"):
                snap = self._snaps.pop((cid, kind), None)
                if snap is not None:
                    self._retire(snap)

    # ---- reading ----

    def best(self, cid: str, prompt) -> Snapshot | None:
        """The longest snapshot of `cid` whose tokens are a proper prefix of `prompt` (one token must remain)."""
        prompt = np.asarray(prompt, np.int32)
        with self._lock:
            found = [s for (c, _), s in self._snaps.items() if c == cid and len(s.tokens) < len(prompt)
                     and np.array_equal(prompt[:len(s.tokens)], s.tokens)]
            if not found:
                return None
            snap = max(found, key=lambda s: len(s.tokens))
            self._snaps.move_to_end((snap.cid, snap.kind))
            return snap

    def read(self, snap: Snapshot, offset: int = 0, size: int | None = None) -> bytes:
        size = snap.nbytes - offset if size is None else min(size, snap.nbytes - offset)
        out = bytearray()
        while size > 0:
            i, within = divmod(offset, self.block)
            n = min(size, self.block - within)
            start = snap.blocks[i] * self.block + within
            out += self.arena[start:start + n].tobytes()
            offset, size = offset + n, size - n
        return bytes(out)

    def segments(self, snap: Snapshot) -> list[tuple[int, int]]:
        """(address, length) of the snapshot's bytes in the arena, in order (NIXL descriptors)."""
        base, left, out = self.arena.ctypes.data, snap.nbytes, []
        for b in snap.blocks:
            n = min(left, self.block)
            out.append((base + b * self.block, n))
            left -= n
        return out

    # ---- leases ----

    def acquire(self, snap: Snapshot) -> Lease:
        with self._lock:
            snap.leases += 1
            lease = Lease(uuid.uuid4().hex, snap, time.monotonic() + self.lease_ttl)
            self._leases[lease.id] = lease
            return lease

    def renew(self, lease_id: str) -> Lease | None:
        with self._lock:
            self._reap()  # an expired lease stays expired: its snapshot may be freed already
            lease = self._leases.get(lease_id)
            if lease is not None:
                lease.deadline = max(lease.deadline, time.monotonic() + self.lease_ttl)
            return lease

    def release(self, lease_id: str) -> Snapshot | None:
        """The leased snapshot, unpinned; None when the lease is unknown or expired (the puller then recomputes)."""
        with self._lock:
            self._reap()
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                return None
            self._unpin(lease.snap)
            return lease.snap

    def _unpin(self, snap: Snapshot) -> None:
        snap.leases -= 1
        if snap.retired and not snap.leases:
            self.free.extend(snap.blocks)
            snap.blocks = []

    def _reap(self) -> None:
        now = time.monotonic()
        for lid in [lid for lid, lease in self._leases.items() if lease.deadline < now]:
            self._unpin(self._leases.pop(lid).snap)

    def reap(self) -> None:
        with self._lock:
            self._reap()

    def lease(self, lease_id: str) -> Lease | None:
        with self._lock:
            self._reap()
            return self._leases.get(lease_id)

    def stats(self) -> dict:
        with self._lock:
            used = (self.arena.size // self.block - len(self.free)) * self.block
            return {"snapshots": len(self._snaps), "leases": len(self._leases), "bytes_used": used,
                    "bytes_budget": self.arena.size, "evictions": self.evictions}
