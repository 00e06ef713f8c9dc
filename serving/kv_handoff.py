"""Cross-server KV handoff, the puller's and the owner's bookkeeping (serving-kv-handoff.md §8.4).

A turn of a named conversation starts from the owner Redis names when that is another live server holding more of
the prompt than this one (`peer`: Acquire -> NIXL READ or chunked Pull -> verify -> Release), else from this
server's host store (`local`), else from nothing (`recompute`). Everything that
can go wrong on the way — Redis down or slow, a stale entry, a dead owner, an expired lease, a replaced snapshot,
a prefix or compat mismatch, a transfer slower than the budget — ends in `recompute` with a reason in the
metrics, never in wrong tokens: bytes are imported only after their length, digest, token prefix and generation
(Release) check out. After a turn the server snapshots the conversation (end of prefill, end of generation)
and claims it in Redis.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import time

import grpc
import jax
import numpy as np

from dsjax.serving.kv_budget import PrefillClock, handoff_budget
from dsjax.serving.kv_layout import Layout, digest
from dsjax.serving.kv_nixl import NixlError
from dsjax.serving.kv_ownership import Ownership, conversation_id
from dsjax.serving.kv_peer import TOKEN_HEADER
from dsjax.serving.kv_store import HostKvStore
from dsjax.serving.proto import kvpeer_pb2 as pb
from dsjax.serving.proto import kvpeer_pb2_grpc as pb_grpc

log = logging.getLogger("dsjax.serving")


@dataclasses.dataclass
class Start:
    """A state row to start a request from: it holds the KV of the prompt's first `tokens` tokens."""
    tokens: int
    row: object
    source: str  # "local" | "peer"


class Miss(Exception):
    """No usable snapshot; `reason` labels the recompute in the metrics."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class KvHandoff:
    def __init__(self, layout: Layout, store: HostKvStore, ownership: Ownership | None, *, token: str,
                 server_id: str, nixl=None, metrics=None, budget_s: float = 2.0, alpha: float = 0.5,
                 floor_s: float = 0.25, prefill_chunk: int = 64):
        self.layout, self.store, self.ownership, self.token = layout, store, ownership, token
        self.server_id, self.nixl, self.metrics, self.budget_s = server_id, nixl, metrics, budget_s
        self.alpha, self.floor_s = alpha, floor_s
        self.prefill = PrefillClock(prefill_chunk)  # the scheduler reports each prompt's prefill time
        self.renewals = 0  # Renew calls made by this puller (tests)
        self.last_budget_s: float | None = None  # the latest turn's budget (observability; each pull gets its own)
        self._secret = token.encode()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dsjax-kv-store")
        self.received_bytes = 0  # every byte that arrived from a peer, imported or discarded (tests wait on it)

    def conversation(self, tenant: str, key: str) -> str:
        return conversation_id(self._secret, tenant, key)

    # ---- puller ----

    def budget(self, prompt_tokens: int, local_tokens: int, deadline_left_s: float | None) -> float:
        """Seconds a pull may take for this turn (kv_budget.handoff_budget over the tokens it would save)."""
        return handoff_budget(self.prefill.estimate(prompt_tokens - local_tokens), deadline_left_s, alpha=self.alpha,
                              floor_s=self.floor_s, cap_s=self.budget_s)

    async def prepare(self, cid: str, prompt: list[int], deadline_left_s: float | None = None) -> Start | None:
        """Where this turn's KV comes from: the owner's snapshot when Redis names another live server holding more
        of the prompt than this one, else this server's own; None: recompute (the reason is counted).
        `deadline_left_s`: the request's remaining deadline (gRPC), which the pull may not outlast."""
        snap = self.store.best(cid, prompt)
        local = None
        if snap is not None:
            local = Start(len(snap.tokens), self.layout.unpack(self.store.read(snap), len(snap.tokens)), "local")
        budget = self.last_budget_s = self.budget(len(prompt), local.tokens if local else 0, deadline_left_s)
        if budget <= 0:
            self._failure("deadline")
            return local
        t0 = time.perf_counter()
        try:
            return await asyncio.wait_for(self._from_owner(cid, prompt, local, budget), budget)
        except Miss as e:
            self._failure(e.reason)
        except asyncio.TimeoutError:
            self._failure("budget")
        except grpc.aio.AioRpcError as e:
            self._failure(f"peer_{e.code().name.lower()}")
        except Exception as e:  # never fail the request over a handoff
            log.warning("kv handoff failed: %s: %s", type(e).__name__, e)
            self._failure("error")
        finally:
            if self.metrics:
                self.metrics.kv_transfer.observe(time.perf_counter() - t0)
        return local

    def _failure(self, reason: str) -> None:
        if self.metrics:
            self.metrics.kv_failures.labels(reason=reason).inc()

    async def _from_owner(self, cid: str, prompt: list[int], local: Start | None, budget: float) -> Start | None:
        if self.ownership is None:
            if local is not None:
                return local
            raise Miss("no_redis")
        try:
            own, srv = await asyncio.to_thread(self.ownership.lookup, cid)
        except Exception as e:  # redis.RedisError, timeouts: Redis is a hint
            raise Miss("redis_unavailable", str(e)) from None
        if not own:
            if local is not None:
                return local
            raise Miss("not_owned")
        if own.get("srv") == self.server_id and local is not None:
            return local
        if local is not None and int(own.get("ntok", 0)) <= local.tokens:
            return local  # the owner holds no more of this conversation than we do
        if own.get("compat") != self.layout.compat:
            raise Miss("incompatible", f"owner {own.get('srv')} writes another layout")
        if own.get("srv") == self.server_id or not srv:  # we evicted it, or the owner is gone: a stale entry
            await self._drop(cid, own)
            raise Miss("stale", f"owner {own.get('srv')} {'is this server' if srv else 'is not alive'}")
        return await self._pull(srv["kvpeer"], cid, prompt, own, budget)

    async def _drop(self, cid: str, own: dict) -> None:
        try:
            await asyncio.to_thread(self.ownership.drop_if, cid, own.get("srv", ""), own.get("epoch", ""))
        except Exception:
            pass

    def _stub(self, addr: str) -> pb_grpc.KvPeerStub:
        ch = self._channels.get(addr)
        if ch is None:
            ch = self._channels[addr] = grpc.aio.insecure_channel(
                addr, options=[("grpc.max_receive_message_length", 64 << 20)])
        return pb_grpc.KvPeerStub(ch)

    async def _pull(self, addr: str, cid: str, prompt: list[int], own: dict, budget: float) -> Start:
        stub, md = self._stub(addr), ((TOKEN_HEADER, self.token),)
        req = pb.AcquireRequest(conversation_id=cid, prompt=prompt, compat=self.layout.compat)
        if self.nixl is not None:
            req.nixl_agent, req.nixl_metadata = self.nixl.name, self.nixl.metadata()
        got = await stub.Acquire(req, metadata=md)
        if got.status != pb.OK:
            if got.status == pb.NOT_FOUND:
                await self._drop(cid, own)
            raise Miss("not_found" if got.status == pb.NOT_FOUND else "incompatible")
        ok = False
        renew = asyncio.create_task(self._renew(stub, md, got.lease_id, got.lease_ttl_ms / 1000))
        try:
            data, path = await self._bytes(stub, md, got, budget)
            n = len(got.tokens)
            if len(data) != got.total_bytes or digest([np.frombuffer(data, np.uint8)]) != got.digest:
                raise Miss("corrupt", f"{len(data)} of {got.total_bytes} bytes, digest mismatch")
            if n >= len(prompt) or list(got.tokens) != prompt[:n]:
                raise Miss("prefix_mismatch")
            row = self.layout.unpack(data, n)
            ok = True
        finally:
            renew.cancel()
            released = await stub.Release(pb.ReleaseRequest(lease_id=got.lease_id, ok=ok), metadata=md)
        if not (released.valid and released.gen == got.gen):
            raise Miss("gen_mismatch", "the snapshot changed or its lease expired during the transfer")
        if self.metrics:
            self.metrics.kv_bytes.labels(path=path).inc(len(data))
        return Start(n, row, "peer")

    async def _renew(self, stub, md, lease_id: str, ttl_s: float) -> None:
        """Keep the lease alive while the transfer runs: Renew every half TTL (the owner frees silent leases)."""
        if ttl_s <= 0:
            return
        while True:
            await asyncio.sleep(ttl_s / 2)
            got = await stub.Renew(pb.LeaseRequest(lease_id=lease_id), metadata=md)
            self.renewals += 1
            if not got.ok:
                return  # expired already: Release will report it and the turn recomputes

    async def _bytes(self, stub, md, got, budget: float) -> tuple[bytes, str]:
        """NIXL READ when offered, else (or after one NIXL failure) the chunked stream."""
        if self.nixl is not None and got.nixl.segments:
            try:
                data = await asyncio.to_thread(self.nixl.read, got.nixl.agent, got.nixl.metadata,
                                               [(s.addr, s.len) for s in got.nixl.segments], budget)
                return data, "nixl"
            except NixlError as e:
                log.warning("NIXL path failed, falling back to chunks once: %s", e)
                self._failure("nixl_fallback")
        buf = bytearray()
        try:
            async for chunk in stub.Pull(pb.PullRequest(lease_id=got.lease_id, offset=0), metadata=md):
                if chunk.offset != len(buf):
                    raise Miss("corrupt", f"chunk at {chunk.offset}, expected {len(buf)}")
                buf += chunk.data
                self.received_bytes += len(chunk.data)
        except BaseException:  # the owner died, the budget ran out, ...: what arrived is never used
            if self.metrics:
                self.metrics.kv_discarded.inc(len(buf))
            raise
        return bytes(buf), "grpc"

    # ---- owner ----

    def snapshot(self, cid: str, kind: str, tokens: list[int], device_row) -> None:
        """Called on the engine thread with a fresh device row; copied to the host store off that thread."""
        self._writer.submit(self._store, cid, kind, list(tokens), device_row)

    def _store(self, cid: str, kind: str, tokens: list[int], device_row) -> None:
        try:
            row = jax.device_get(device_row)
            n = int(np.asarray(row.lengths)[0])
            snap = self.store.put(cid, kind, tokens[:n], self.layout.pack(row, n))
            if snap is None:
                log.warning("kv store: a %d-token snapshot does not fit the budget", n)
                return
            if self.ownership is not None:
                self.ownership.claim(cid, snap.gen, n, self.layout.compat)
        except Exception as e:  # the turn is served either way; the next one recomputes
            log.warning("kv snapshot of %s failed: %s: %s", cid[:8], type(e).__name__, e)

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every queued snapshot is stored (tests, drain)."""
        self._writer.submit(lambda: None).result(timeout)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._writer.shutdown(wait=False)
