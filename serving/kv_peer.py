"""The owner side of a KV handoff: the internal `KvPeer` gRPC service over this server's host KV store.

Acquire pins the longest snapshot of the conversation that prefixes the puller's prompt (a lease with a
deadline; the puller renews) and offers NIXL descriptors of its arena blocks when both sides have NIXL; Pull
streams the same bytes in chunks (path B, always there); Release unpins and says whether the snapshot is still
the one acquired. Every call needs the cluster token (constant-time comparison); nothing is unpickled.
"""

from __future__ import annotations

import asyncio
import hmac

import grpc

from dsjax.serving.kv_layout import Layout
from dsjax.serving.kv_store import HostKvStore
from dsjax.serving.proto import kvpeer_pb2 as pb
from dsjax.serving.proto import kvpeer_pb2_grpc as pb_grpc

TOKEN_HEADER = "x-cluster-token"


class KvPeerServicer(pb_grpc.KvPeerServicer):
    def __init__(self, store: HostKvStore, layout: Layout, token: str, boot_id: str, *, chunk_bytes: int = 1 << 20,
                 nixl=None, chunk_delay_s: float = 0.0):
        self.store, self.layout, self.token, self.boot_id = store, layout, token.encode(), boot_id
        self.chunk, self.nixl, self.chunk_delay = chunk_bytes, nixl, chunk_delay_s

    async def _authorize(self, context) -> None:
        md = dict(context.invocation_metadata() or ())
        if not hmac.compare_digest(md.get(TOKEN_HEADER, "").encode(), self.token):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token")

    async def Acquire(self, request, context):
        await self._authorize(context)
        if request.compat != self.layout.compat:
            return pb.AcquireResponse(status=pb.INCOMPATIBLE, compat=self.layout.compat, boot_id=self.boot_id)
        snap = self.store.best(request.conversation_id, list(request.prompt))
        if snap is None:
            return pb.AcquireResponse(status=pb.NOT_FOUND, boot_id=self.boot_id)
        lease = self.store.acquire(snap)
        out = pb.AcquireResponse(status=pb.OK, gen=snap.gen, tokens=snap.tokens.tolist(), lease_id=lease.id,
                                 lease_ttl_ms=int(self.store.lease_ttl * 1000), total_bytes=snap.nbytes,
                                 chunk_size=self.chunk, digest=snap.digest, boot_id=self.boot_id,
                                 compat=self.layout.compat)
        if self.nixl is not None and request.nixl_agent:
            self.nixl.progress_while(lambda: self.store.lease(lease.id) is not None)
            out.nixl.CopyFrom(pb.NixlPath(agent=self.nixl.name, metadata=self.nixl.metadata(), segments=[
                pb.Segment(addr=a, len=n) for a, n in self.store.segments(snap)]))
        return out

    async def Pull(self, request, context):
        await self._authorize(context)
        lease = self.store.lease(request.lease_id)
        if lease is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such lease (expired or released)")
        offset = request.offset
        while offset < lease.snap.nbytes:
            if self.store.lease(request.lease_id) is None:  # lapsed mid-stream: its blocks may be reused now
                await context.abort(grpc.StatusCode.NOT_FOUND, "the lease expired during the transfer")
            data = self.store.read(lease.snap, offset, self.chunk)
            yield pb.PullChunk(offset=offset, data=data)
            offset += len(data)
            if self.chunk_delay:  # tests: widen the window in which the owner can die mid-transfer
                await asyncio.sleep(self.chunk_delay)

    async def Renew(self, request, context):
        await self._authorize(context)
        return pb.RenewResponse(ok=self.store.renew(request.lease_id) is not None)

    async def Release(self, request, context):
        await self._authorize(context)
        snap = self.store.release(request.lease_id)
        if snap is None:
            return pb.ReleaseResponse(valid=False)
        return pb.ReleaseResponse(valid=not snap.retired, gen=snap.gen)


class KvPeerServer:
    """The aio server on its own (internal) port."""

    def __init__(self, servicer: KvPeerServicer):
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_KvPeerServicer_to_server(servicer, self.server)
        self.port = 0

    def bind(self, host: str, port: int) -> int:
        self.port = self.server.add_insecure_port(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
        if not self.port:
            raise OSError(f"could not bind the KvPeer port {host}:{port}")
        return self.port
