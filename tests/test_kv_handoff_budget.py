"""The puller's clock: the handoff budget (α × the prefill a pull saves, within a floor, a cap and the request's
deadline), lease renewal during a long transfer, and what a lapsed lease, a snapshot replaced mid-transfer or a
deadline shorter than the transfer do to a pull — each ending in a recompute with its reason counted.

No model: a synthetic state row over a real `redis-server`, a real KvPeer gRPC server on 127.0.0.1 and the real
puller. The owner streams 64 KiB in 4 KiB chunks 40 ms apart (~0.65 s), against a 0.3 s lease.
"""

import asyncio
import tempfile
import time

import numpy as np
import pytest

from dsjax.serving.kv_budget import PrefillClock, handoff_budget
from dsjax.serving.kv_handoff import KvHandoff
from dsjax.serving.kv_layout import Layout
from dsjax.serving.kv_ownership import Ownership
from dsjax.serving.kv_peer import KvPeerServer, KvPeerServicer
from dsjax.serving.kv_store import HostKvStore
from dsjax.state import DecodeState, LayerState
from kv_cluster import Redis

TOKEN = "t" * 32


def test_budget_maths():
    b = lambda est, left=None: handoff_budget(est, left, alpha=0.5, floor_s=0.25, cap_s=2.0)
    assert b(None) == 2.0                 # nothing measured yet: the cap
    assert b(1.0) == 0.5                  # α x the prefill it saves
    assert b(0.1) == 0.25                 # never below the floor ...
    assert b(60.0) == 2.0                 # ... nor above the cap
    assert b(1.0, left=0.3) == 0.3        # nor past the deadline
    assert b(1.0, left=-1.0) == 0.0       # deadline gone: do not try


def test_prefill_clock_skips_the_compile_and_averages():
    clock = PrefillClock(chunk_tokens=64)
    assert clock.estimate(100) is None
    clock.observe(64, 30.0)               # the first prompt compiles: dropped
    assert clock.estimate(100) is None
    clock.observe(128, 0.2)               # 2 chunks: 0.1 s each
    assert clock.estimate(129) == pytest.approx(0.3)
    clock.observe(64, 0.2)                # 0.2 s a chunk, weight 0.2
    assert clock.seconds_per_chunk == pytest.approx(0.12)
    clock.observe(0, 1.0)                 # a fully cached prompt says nothing about prefill
    assert clock.seconds_per_chunk == pytest.approx(0.12)


def _row(rng, n):
    window = rng.normal(size=(1, 64, 256)).astype(np.float32)  # 64 KiB: 16 chunks of 4 KiB
    return DecodeState(lengths=np.array([n], np.int32),
                       layers=(LayerState(window=window, compressor=None, index=None),), mtp=())


class _Cluster:
    """Owner A (store + KvPeer + Redis claim) and puller B, in this event loop."""

    def __init__(self, redis_url: str, rng):
        self.row = _row(rng, 10)
        self.layout = Layout(self.row, 64, "synthetic")
        self.prompt = list(range(100, 116))
        self.store_a = HostKvStore(1 << 20, block_bytes=16 << 10, lease_ttl_s=0.3)
        self.servicer = KvPeerServicer(self.store_a, self.layout, TOKEN, "boot-a", chunk_bytes=4096,
                                       chunk_delay_s=0.04)
        self.server = KvPeerServer(self.servicer)
        port = self.server.bind("127.0.0.1", 0)
        self.own_a = Ownership(redis_url, "A", "boot-a", f"127.0.0.1:{port}", timeout_s=1)
        self.own_a.heartbeat()
        self.b = KvHandoff(self.layout, HostKvStore(1 << 20, block_bytes=16 << 10),
                           Ownership(redis_url, "B", "boot-b", "127.0.0.1:1", timeout_s=1), token=TOKEN,
                           server_id="B", budget_s=5.0, floor_s=5.0)
        self.cid = self.b.conversation("tenant", "conv")
        self.failures = []
        self.b._failure = self.failures.append

    def own(self, tokens):
        snap = self.store_a.put(self.cid, "prompt", tokens, self.layout.pack(self.row, len(tokens)))
        self.own_a.claim(self.cid, snap.gen, len(tokens), self.layout.compat)
        return snap

    async def pull(self, deadline=None):
        t0 = time.monotonic()
        got = await self.b.prepare(self.cid, self.prompt, deadline)
        return got, time.monotonic() - t0


def test_long_pull_renews_its_lease_and_lapses_without(test_seed):
    async def main(redis_url):
        c = _Cluster(redis_url, np.random.default_rng(test_seed))
        await c.server.server.start()
        try:
            c.own(c.prompt[:10])
            got, took = await c.pull()
            print(f"pull with renewals: {took:.2f} s, {c.b.renewals} renewals, failures {c.failures}")
            assert got is not None and got.source == "peer" and got.tokens == 10, c.failures
            assert took > 0.3 and c.b.renewals >= 2
            np.testing.assert_array_equal(np.asarray(got.row.layers[0].window), c.row.layers[0].window)

            async def no_renew(*a):
                return None
            c.b._renew = no_renew              # a puller that never renews: the 0.3 s lease lapses mid-transfer
            c.own(c.prompt[:10])
            got, took = await c.pull()
            assert got is None and c.failures == ["peer_not_found"], c.failures  # the owner stops the stream
            assert took < 0.6
            del c.b._renew

            c.failures.clear()                 # the owner replaces the snapshot mid-transfer (a later turn)
            c.own(c.prompt[:10])
            task = asyncio.ensure_future(c.pull())
            await asyncio.sleep(0.2)
            c.own(c.prompt[:12])
            got, _ = await task
            assert got is None and c.failures == ["gen_mismatch"], c.failures

            c.failures.clear()                 # a request deadline shorter than the transfer
            got, took = await c.pull(deadline=0.2)
            assert got is None and c.failures == ["budget"] and took < 0.5, (c.failures, took)
            assert c.b.last_budget_s == pytest.approx(0.2)
            got, took = await c.pull(deadline=0.0)
            assert got is None and c.failures[-1] == "deadline" and took < 0.05
        finally:
            await c.server.server.stop(0)
            await c.b.close()
            c.own_a.stop()

    with tempfile.TemporaryDirectory() as tmp:
        redis = Redis(tmp)
        try:
            asyncio.run(asyncio.wait_for(main(redis.url), 60))
        finally:
            redis.stop()
