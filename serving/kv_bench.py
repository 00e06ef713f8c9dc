"""KV handoff vs recompute on loopback, and bytes per token of the snapshot layouts (docs/benchmarks.md).

    python -m dsjax.serving.kv_bench --tokens 1024 4096 16384 --transport grpc
    python -m dsjax.serving.kv_bench --layouts-only

Two servers in this process on the same weights (tiny-v4, random, numerics transformers), one `redis-server` on
a free loopback port. For each length N: turn 1 (N prompt tokens) on A; turn 2 (N + 1 tokens, the same
conversation) on B, which pulls A's snapshot; the same N + 1 tokens on B without a conversation (a recompute).
Reported: time to first token of both, the transfer (lookup + acquire + bytes + verify), bytes shipped.
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--transport", default="grpc", choices=["auto", "nixl", "grpc"])
    p.add_argument("--prefill-chunk", type=int, default=1024)
    p.add_argument("--layouts-only", action="store_true")
    args = p.parse_args(argv)
    rows = [layout_bytes(m) for m in ("v4-flash", "v4.1-flash")]
    for r in rows:
        print(json.dumps(r))
    if args.layouts_only:
        return 0
    import socket

    import httpx2 as httpx
    import numpy as np

    import dsjax
    from dsjax.serving.config import ServeConfig
    from dsjax.serving.server import ServerThread, build

    os.environ.setdefault("UCX_TLS", "tcp")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        redis = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save",
                                  "", "--dir", tmp], stdout=subprocess.DEVNULL)
        max_len = max(args.tokens) + 64
        model = dsjax.load("tiny-v4", numerics="transformers", max_seq_len=max_len, max_batch=1)
        servers = []
        try:
            for name in ("A", "B"):
                cfg = ServeConfig(model="tiny-v4", numerics="transformers", max_num_seqs=1, max_model_len=max_len,
                                  port=0, grpc_port=-1, prefill_chunk=args.prefill_chunk, steps_per_dispatch=1,
                                  max_logprobs=0, prefix_cache_entries=0, redis_url=f"redis://127.0.0.1:{port}/0",
                                  server_id=name, kv_peer_port=0, cluster_token="bench-token-0123456789",
                                  kv_store_bytes=1 << 30, kv_handoff_timeout=600, kv_transport=args.transport)
                servers.append(ServerThread(cfg, build(cfg, model=model)).start(timeout=900))
            a, b = (f"http://127.0.0.1:{s.server.http_port}/v1/completions" for s in servers)
            rng = np.random.default_rng(0)
            with httpx.Client(timeout=3600) as c:
                def ttft(url, prompt, key=None):
                    body = {"model": "tiny-v4", "prompt": prompt, "max_tokens": 1, "temperature": 0}
                    if key:
                        body["prompt_cache_key"] = key
                    t0 = time.perf_counter()
                    r = c.post(url, json=body).json()
                    return time.perf_counter() - t0, r["usage"]["prompt_tokens_details"]["cached_tokens"]

                ttft(a, [0, 5, 6])  # first requests pay no compile below
                for n in args.tokens:
                    prompt = [0] + rng.integers(3, 120_000, n - 1).tolist()
                    ttft(a, prompt, key=f"c{n}")
                    servers[0].svc.kv.flush()
                    m = servers[1].svc.metrics
                    t_sum, bytes_before = m.kv_transfer._sum.get(), sum(
                        m.kv_bytes.labels(path=p)._value.get() for p in ("nixl", "grpc"))
                    t_handoff, cached = ttft(b, prompt + [7], key=f"c{n}")
                    transfer = m.kv_transfer._sum.get() - t_sum
                    shipped = sum(m.kv_bytes.labels(path=p)._value.get() for p in ("nixl", "grpc")) - bytes_before
                    t_recompute, _ = ttft(b, prompt + [8])
                    print(json.dumps({"tokens": n, "cached": cached, "ttft_handoff_s": round(t_handoff, 3),
                                      "transfer_s": round(transfer, 3), "bytes": int(shipped),
                                      "ttft_recompute_s": round(t_recompute, 3),
                                      "speedup": round(t_recompute / t_handoff, 1)}), flush=True)
        finally:
            for s in servers:
                s.stop()
            redis.terminate()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
