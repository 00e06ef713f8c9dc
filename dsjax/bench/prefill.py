"""`dsjax bench prefill`: prompt tokens/s and MFU of chunked prefill on a layer slice, 8k … 128k tokens, the
full model extrapolated from two slice depths, and a 1M-token projection with its assumptions.

MFU = forward FLOPs (roofline.flops_per_token at each position's context: active weights, attention over window
+ compressed entries, the CSA indexer) / seconds / the bf16 matmul rate torch measures in the same run.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

ONE_M = 1 << 20


def add_args(p) -> None:
    p.add_argument("--model", default="slice:v4-flash:4", help="slice:v4-flash[:LAYERS[:EXPERTS]] (default :4)")
    p.add_argument("--lengths", default="8192,16384,32768,65536,131072", help="prompt lengths (comma-separated)")
    p.add_argument("--chunk", type=int, default=1024, help="prefill chunk (tokens per forward, default 1024)")
    p.add_argument("--kernels", default="auto", choices=["auto", "xla", "pallas"], help="op implementations")
    p.add_argument("--proxy-layers", type=int, default=2,
                   help="also time the slice without its last N layers, to extrapolate the full model (0 = skip)")
    p.add_argument("--out", default=None, help="write the JSON report here")


def prefill_seconds(model, length: int, chunk: int, seed: int = 0) -> tuple[float, float]:
    """(seconds to prefill `length` random tokens in chunks, seconds of the first chunk incl. compile)."""
    import jax
    import jax.numpy as jnp

    from dsjax.model import forward_chunk
    from dsjax.state import init_state

    cfg = model.cfg
    step = jax.jit(lambda p, t, s: forward_chunk(p, cfg, t, s)[1], donate_argnums=2)
    ids = np.random.default_rng(seed).integers(0, cfg.vocab_size, (1, length)).astype(np.int32)
    dev = jax.devices()[0]

    def fresh():  # committed like the step's outputs, so the jit cache keys the same: one compile
        return jax.device_put(init_state(cfg, 1, -(-length // chunk) * chunk + chunk), dev)

    state = fresh()
    t0 = time.perf_counter()
    state = jax.block_until_ready(step(model.params, jax.device_put(jnp.asarray(ids[:, :chunk]), dev), state))
    first = time.perf_counter() - t0
    state = jax.block_until_ready(fresh())
    t0 = time.perf_counter()
    for s in range(0, length, chunk):
        state = step(model.params, jax.device_put(jnp.asarray(ids[:, s:s + chunk]), dev), state)
    jax.block_until_ready(state)
    return time.perf_counter() - t0, first


def run(args) -> int:
    from dsjax.bench.report import write_report
    from dsjax.bench.roofline import flops_per_token, torch_roofline
    from dsjax.bench.slices import extrapolate_depth, full_config, shallower, slice_model

    roof = torch_roofline()
    lengths = [int(x) for x in args.lengths.split(",")]
    model = slice_model(args.model, kernels=args.kernels, max_seq_len=max(lengths) + args.chunk)
    cfg = model.cfg
    full = full_config(cfg)
    depths = {cfg.n_layers: model}
    if args.proxy_layers:
        L1 = cfg.n_layers - args.proxy_layers
        depths[L1] = shallower(model, L1)
    peak = roof.get("matmul_TFLOPs")
    rows = []
    for n in lengths:
        row = {"tokens": n, "chunk": args.chunk}
        for L, m in sorted(depths.items()):
            secs, first = prefill_seconds(m, n, args.chunk)
            flops = n * flops_per_token(m.cfg, n / 2)
            row[f"slice{L}"] = {"s": secs, "tokens_per_s": n / secs, "first_chunk_s": first,
                                "mfu": flops / secs / (peak * 1e12) if peak else None}
        if len(depths) == 2:
            L1, L2 = sorted(depths)
            t1, t2 = row[f"slice{L1}"]["s"], row[f"slice{L2}"]["s"]
            _, t_full = extrapolate_depth(t1, t2, L1, L2, full.n_layers)
            flops = n * flops_per_token(full, n / 2)
            row["full_extrapolated"] = {"s": t_full, "tokens_per_s": n / t_full,
                                        "mfu": flops / t_full / (peak * 1e12) if peak else None}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    projection = None
    if len(depths) == 2 and len(rows) >= 2:
        S = np.asarray([r["tokens"] for r in rows], np.float64)
        T = np.asarray([r["full_extrapolated"]["s"] for r in rows])
        (a, b), *_ = np.linalg.lstsq(np.stack([S, S * S], 1), T, rcond=None)
        t1m = a * ONE_M + b * ONE_M ** 2
        projection = {"tokens": ONE_M, "s_one_gpu_equivalent": t1m, "tokens_per_s": ONE_M / t1m,
                      "fit": {"a_s_per_token": a, "b_s_per_token2": b},
                      "assumptions": "t(S) = a*S + b*S^2 fitted to the extrapolated full-model times above (linear "
                                     "weights term, attention/indexer growing with context); same chunk and kernels; "
                                     "one H200's compute and bandwidth (the full V4-Flash weights need two: divide by "
                                     "the TP speed-up for a real deployment); caches fit."}
    write_report("prefill", None, args.out, model=model.source, config=cfg.name, roofline=roof, rows=rows,
                 one_million=projection, rival={"engine": "rival (V4.1-Flash, 8xB300)", "one_million_s": 11.7,
                                                "tokens_per_s": 85000})
    return 0


if __name__ == "__main__":
    from dsjax.bench.report import script_main

    raise SystemExit(script_main(__spec__.name))
