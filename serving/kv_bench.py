"""KV handoff vs recompute on loopback, and bytes per token of the snapshot layouts (docs/benchmarks.md).

    python -m dsjax.serving.kv_bench --tokens 1024 4096 --transport grpc     # end to end, per length
    python -m dsjax.serving.kv_bench --transfer 1024 16384 100000               # the handoff alone
    python -m dsjax.serving.kv_bench --layouts-only

End to end (--tokens): two servers in this process on the same weights (tiny-v4, random, --numerics transformers,
max_model_len = N + 64, so the fixed-shape caches fit the conversation), one `redis-server` on a free loopback
port. Turn 1 (N prompt tokens) on A; turn 2 (N + 1 tokens, the same conversation) on B, which pulls A's snapshot;
the same N + 1 tokens on B without a conversation (a recompute). Reported: time to first token of both, the
transfer (lookup + acquire + bytes + verify + unpack), bytes shipped.

The handoff alone (--transfer): no model runs; the owner's store holds a snapshot of N tokens (tiny-v4 layout,
random bytes), Redis names it, the puller's `KvHandoff.prepare` fetches it over NIXL and over chunked gRPC.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time


def layout_bytes(preset: str, max_seq: int = 1 << 17) -> dict:
    """Snapshot bytes of one conversation for a model layout: fixed part and per token (no arrays allocated)."""
    import jax
    import jax.numpy as jnp

    import dsjax
    from dsjax.serving.kv_layout import Layout
    from dsjax.serving.prefix_cache import take_row
    from dsjax.state import init_state

    cfg = dsjax.preset(preset).with_numerics("reference-bf16")  # the serving default: compact KV rows
    row = jax.eval_shape(lambda: take_row(init_state(cfg, 1, max_seq), jnp.int32(0)))
    layout = Layout(row, max_seq, preset)
    n = max_seq - max_seq % 128
    fixed = layout.nbytes(0)
    return {"model": preset, "fixed_bytes": fixed, "bytes_per_token": (layout.nbytes(n) - fixed) / n,
            "bytes_100k": layout.nbytes(100_000)}


def _redis(tmp: str):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--dir", tmp], stdout=subprocess.DEVNULL)
    time.sleep(0.5)
    return proc, f"redis://127.0.0.1:{port}/0"


def _tiny(max_len: int, numerics: str = "transformers"):
    import dsjax
    from dsjax.params import init_params

    cfg = dsjax.preset("tiny-v4", max_position_embeddings=max(max_len, 4096)).with_numerics(numerics)
    return dsjax.Model(cfg, init_params(cfg, 0), source="tiny-v4 (random weights, seed 0)", max_seq_len=max_len,
                       max_batch=1)  # tiny-v4 stretched past its 4096-token preset limit: timing only


def end_to_end(n: int, transport: str, chunk: int, redis_url: str, numerics: str = "transformers") -> dict:
    import httpx2 as httpx
    import numpy as np

    from dsjax.serving.config import ServeConfig
    from dsjax.serving.server import ServerThread, build

    model, servers = _tiny(n + 64, numerics), []
    try:
        for name in ("A", "B"):
            cfg = ServeConfig(model="tiny-v4", numerics=numerics, max_num_seqs=1, max_model_len=n + 64, port=0,
                              grpc_port=-1, prefill_chunk=min(chunk, n), steps_per_dispatch=1, max_logprobs=0,
                              prefix_cache_entries=0, redis_url=redis_url, server_id=f"{name}{n}", kv_peer_port=0,
                              cluster_token="bench-token-0123456789", kv_store_bytes=1 << 30,
                              kv_handoff_timeout=600, kv_transport=transport)
            servers.append(ServerThread(cfg, build(cfg, model=model)).start(timeout=1800))
        a, b = (f"http://127.0.0.1:{s.server.http_port}/v1/completions" for s in servers)
        prompt = [0] + np.random.default_rng(n).integers(3, 120_000, n - 1).tolist()
        with httpx.Client(timeout=3600) as c:
            def ttft(url, prompt, key=None):
                body = {"model": "tiny-v4", "prompt": prompt, "max_tokens": 1, "temperature": 0}
                t0 = time.perf_counter()
                r = c.post(url, json={**body, "prompt_cache_key": key} if key else body).json()
                return time.perf_counter() - t0, r["usage"]["prompt_tokens_details"]["cached_tokens"]

            ttft(a, prompt, key="conv")
            servers[0].svc.kv.flush()
            m = servers[1].svc.metrics
            t_sum = m.kv_transfer._sum.get()
            shipped = [m.kv_bytes.labels(path=p)._value.get() for p in ("nixl", "grpc")]
            t_handoff, cached = ttft(b, prompt + [7], key="conv")
            transfer = m.kv_transfer._sum.get() - t_sum
            shipped = [m.kv_bytes.labels(path=p)._value.get() - s for p, s in zip(("nixl", "grpc"), shipped)]
            t_recompute, _ = ttft(b, prompt + [8])
        return {"tokens": n, "cached": cached, "path": "nixl" if shipped[0] else "grpc", "bytes": int(sum(shipped)),
                "handoff_s": round(transfer, 4), "ttft_after_handoff_s": round(t_handoff, 2),
                "ttft_recompute_s": round(t_recompute, 2), "speedup": round(t_recompute / t_handoff, 1)}
    finally:
        for s in servers:
            s.stop()


def transfer_only(sizes: list[int], redis_url: str) -> list[dict]:
    """The handoff itself for snapshots of N tokens: Redis lookup, Acquire, bytes (NIXL or chunks), digest, prefix,
    Release, unpack. Two KvPeer services in this process; the layout is tiny-v4's at max_seq = max(sizes) + 64."""
    import asyncio

    import jax
    import jax.numpy as jnp
    import numpy as np

    from dsjax.serving import kv_nixl
    from dsjax.serving.kv_handoff import KvHandoff
    from dsjax.serving.kv_layout import Layout
    from dsjax.serving.kv_ownership import Ownership
    from dsjax.serving.kv_peer import KvPeerServer, KvPeerServicer
    from dsjax.serving.kv_store import HostKvStore
    from dsjax.serving.prefix_cache import take_row
    from dsjax.state import init_state

    max_seq, token = max(sizes) + 64, "bench-token-0123456789"
    cfg = _tiny(max_seq).cfg
    layout = Layout(jax.eval_shape(lambda: take_row(init_state(cfg, 1, max_seq), jnp.int32(0))), max_seq, "bench")
    budget = 2 * layout.nbytes(max_seq) + (8 << 20)

    async def run():
        sides = []
        for name in ("A", "B"):
            store = HostKvStore(budget)
            nixl = kv_nixl.NixlEndpoint(f"bench-{name}", store.arena, budget) if kv_nixl.available() else None
            server = KvPeerServer(KvPeerServicer(store, layout, token, name, nixl=nixl))
            port = server.bind("127.0.0.1", 0)
            await server.server.start()
            own = Ownership(redis_url, name, name, f"127.0.0.1:{port}", timeout_s=1)
            own.heartbeat()
            sides.append((KvHandoff(layout, store, own, token=token, server_id=name, nixl=nixl, budget_s=600),
                          server))
        (a, _), (b, _) = sides
        out = []
        for n in sizes:
            tokens = list(range(1, n + 1))
            pieces = [np.random.default_rng(n).integers(0, 255, layout.nbytes(n), dtype=np.uint8)]
            pieces[0][:4] = np.frombuffer(np.int32(n).tobytes(), np.uint8)  # the row's length leaf
            snap = a.store.put(f"c{n}", "final", tokens, pieces)
            a.ownership.claim(f"c{n}", snap.gen, n, layout.compat)
            row = {}
            for path in ("nixl", "grpc") if b.nixl else ("grpc",):
                nixl, b.nixl = b.nixl, (b.nixl if path == "nixl" else None)
                t0 = time.perf_counter()
                start = await b.prepare(f"c{n}", tokens + [0])
                row[f"{path}_s"] = round(time.perf_counter() - t0, 4)
                b.nixl = nixl
                assert start is not None and start.tokens == n, f"{path}: no handoff at {n} tokens"
            out.append({"tokens": n, "bytes": snap.nbytes, **row})
            print(json.dumps(out[-1]), flush=True)
        for kv, server in sides:
            await server.server.stop(0)
            await kv.close()
        return out

    return asyncio.run(run())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="*", default=[])
    p.add_argument("--transfer", type=int, nargs="*", default=[])
    p.add_argument("--transport", default="auto", choices=["auto", "nixl", "grpc"])
    p.add_argument("--prefill-chunk", type=int, default=1024)
    p.add_argument("--numerics", default="transformers", choices=["transformers", "reference-bf16"],
                   help="end to end: the servers' numerics (reference-bf16 prefills long prompts much faster on a "
                        "CPU: HCA layers attend through shared rows instead of per-token copies)")
    p.add_argument("--layouts-only", action="store_true")
    args = p.parse_args(argv)
    for m in ("v4-flash", "v4.1-flash"):
        print(json.dumps(layout_bytes(m)), flush=True)
    if args.layouts_only:
        return 0
    os.environ.setdefault("UCX_TLS", "tcp")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    with tempfile.TemporaryDirectory() as tmp:
        redis, url = _redis(tmp)
        try:
            if args.transfer:
                transfer_only(args.transfer, url)
            for n in args.tokens:
                print(json.dumps(end_to_end(n, args.transport, args.prefill_chunk, url, args.numerics)), flush=True)
        finally:
            redis.terminate()
            redis.wait(10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
