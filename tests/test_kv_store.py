"""The KV handoff's pieces on their own, no model: the host store's byte budget, LRU and leases; the snapshot
byte layout; Redis ownership scripts against a real `redis-server` (epoch fencing, compare-and-delete, tenants)."""

import tempfile

import jax
import numpy as np
import pytest

from dsjax.serving.kv_layout import Layout, digest
from dsjax.serving.kv_ownership import Ownership, conversation_id
from dsjax.serving.kv_store import HostKvStore
from kv_cluster import Redis


def _bytes(n, fill):
    return [np.full(n, fill, np.uint8)]


def test_store_budget_lru_and_leases():
    store = HostKvStore(budget_bytes=4 * 1024, block_bytes=1024)
    a = store.put("a", "final", [1, 2], _bytes(1500, 1))      # 2 blocks
    b = store.put("b", "final", [1, 3], _bytes(1024, 2))      # 1 block
    assert a is not None and b is not None
    lease = store.acquire(a)
    assert store.best("b", [1, 3, 4]) is b                     # b is now the most recently used
    c = store.put("c", "final", [5], _bytes(2048, 3))          # needs 2 blocks: b goes (a is leased)
    assert store.best("b", [1, 3, 4]) is None and c is not None
    assert store.read(a) == bytes(_bytes(1500, 1)[0]) and store.best("a", [1, 2, 9]) is a
    assert store.put("d", "final", [6], _bytes(4096, 4)) is None, "evicted a leased snapshot"
    newer = store.put("a", "final", [1, 2], _bytes(1500, 5))   # replaced while leased: old blocks stay pinned
    assert newer is not None and newer.gen > a.gen and a.retired and a.blocks
    assert store.read(a) == bytes(_bytes(1500, 1)[0])
    store.release(lease.id)
    assert not a.blocks, "a retired snapshot's blocks were not freed with its last lease"
    store.lease_ttl = 0.0
    short = store.acquire(newer)
    store.reap()
    assert store.lease(short.id) is None and newer.leases == 0
    assert store.best("a", [1]) is None, "a snapshot must leave at least one prompt token"
    assert [n for _, n in store.segments(newer)] == [1024, 476]


def test_layout_trims_compressed_caches_and_skips_the_mtp_ring():
    from dsjax.state import CompressorState, DecodeState, LayerState

    rng = np.random.default_rng(0)
    comp = CompressorState(kv=rng.normal(size=(1, 8, 4)).astype(np.float32),
                           score=rng.normal(size=(1, 8, 4)).astype(np.float32),
                           entries=rng.normal(size=(1, 16, 3)).astype(np.float32))  # ratio 64 // 16 = 4
    row = DecodeState(lengths=np.array([10], np.int32),
                      layers=(LayerState(window=np.ones((1, 4, 3), np.float32), compressor=comp, index=None),),
                      mtp=(LayerState(window=np.ones((1, 4, 3), np.float32), compressor=None, index=None),))
    lay = Layout(jax.tree.map(np.asarray, row), 64, "m")
    plain = Layout(DecodeState(row.lengths, row.layers, ()), 64, "m")
    assert lay.compat == plain.compat, "the MTP ring must not change the layout"
    assert Layout(row, 64, "other weights").compat != lay.compat
    pieces = lay.pack(row, 10)
    assert sum(p.size for p in pieces) == lay.nbytes(10) == 4 + 4 * 3 * 4 + 2 * 8 * 4 * 4 + 2 * 3 * 4
    back = lay.unpack(b"".join(p.tobytes() for p in pieces), 10)
    np.testing.assert_array_equal(back.layers[0].compressor.entries[:, :2], comp.entries[:, :2])
    assert not back.layers[0].compressor.entries[:, 2:].any() and not back.mtp[0].window.any()
    np.testing.assert_array_equal(plain.unpack(b"".join(p.tobytes() for p in pieces), 10).layers[0].window,
                                  row.layers[0].window)
    with pytest.raises(ValueError, match="bytes"):
        lay.unpack(b"\0" * 7, 10)
    assert digest(pieces) != digest(lay.pack(row, 12))  # one more compressed entry shipped


def test_redis_ownership_scripts():
    with tempfile.TemporaryDirectory() as tmp:
        redis = Redis(tmp)
        try:
            x = Ownership(redis.url, "X", "boot-x", "127.0.0.1:1", timeout_s=1)
            y = Ownership(redis.url, "Y", "boot-y", "127.0.0.1:2", timeout_s=1)
            e1 = x.claim("c", gen=7, ntok=10, compat="k")
            x.heartbeat()
            own, srv = y.lookup("c")
            assert (own["srv"], own["gen"], own["ntok"], srv["kvpeer"]) == ("X", "7", "10", "127.0.0.1:1")
            e2 = y.claim("c", gen=9, ntok=20, compat="k")             # a later turn elsewhere: higher epoch wins
            assert e2 > e1
            assert not x.drop_if("c", "X", str(e1)), "a stale compare-and-delete removed a newer claim"
            own, srv = x.lookup("c")
            assert own["srv"] == "Y" and srv == {}                   # Y has no liveness key: not alive
            assert y.drop_if("c", "Y", str(e2)) and x.lookup("c") == ({}, {})
            assert redis.client().pttl("kv:{c}:epoch") > 0
        finally:
            redis.stop()
    assert conversation_id(b"s", "tenant-1", "k") != conversation_id(b"s", "tenant-2", "k")
    assert conversation_id(b"s", "t", "k") != conversation_id(b"other secret", "t", "k")
