"""`dsjax bench prefill`: prompt tokens/s and MFU of chunked prefill on a layer slice, 8k … 128k tokens, the
full model extrapolated from two slice depths, and a 1M-token projection with its assumptions.

MFU = forward FLOPs (roofline.flops_per_token at each position's context: active weights, attention over window
+ compressed entries, the CSA indexer) / seconds / the bf16 matmul rate torch measures in the same run.

V4.1 slices (`slice:v4.1-flash[:LAYERS]`) time each `--schedule`: `exact` (every layer for every prompt token)
and `replay` (CED with SWA bounded replay, `dsjax.v41_replay`: encoder layers and the ratio-1 source's compressor
for every token, decoder layers for the last window only). The shallower depth keeps the slice's encoder layers
only, so the full model is extrapolated per kind: encoder-layer time x the full model's encoder layers plus
decoder-layer time x its decoder layers (the replay's decoder part scaled the same way: an upper bound, since
the source's compressor, which does not repeat, is counted in it).

    dsjax bench prefill --model slice:v4-flash:4 --lengths 8192,65536
    dsjax bench prefill --model slice:v4.1-flash:8 --schedule exact,replay --proxy-layers 3
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from dsjax.config import KERNELS_HELP, kernels_arg
from dsjax.errors import ConfigError

ONE_M = 1 << 20


def add_args(p) -> None:
    p.add_argument("--model", default="slice:v4-flash:4", help="slice:v4-flash[:LAYERS[:EXPERTS]] (default :4)")
    p.add_argument("--lengths", default="8192,16384,32768,65536,131072", help="prompt lengths (comma-separated)")
    p.add_argument("--chunk", type=int, default=1024, help="prefill chunk (tokens per forward, default 1024)")
    p.add_argument("--kernels", default="auto", type=kernels_arg, help=KERNELS_HELP)
    p.add_argument("--reindex-scope", default="all", choices=("all", "candidates"),
                   help="V4.1 Reindex layers: score every key and mask ('all', the default) or only the candidate positions ('candidates'): the same picks, less work at long context")
    p.add_argument("--proxy-layers", type=int, default=2,
                   help="also time the slice without its last N layers, to extrapolate the full model (0 = skip; "
                        "V4.1: N must drop exactly the decoder layers, 3 for a full 8-layer slice)")
    p.add_argument("--schedule", default="exact",
                   help="V4.1 prefill schedules, comma-separated: exact, replay (default exact)")
    p.add_argument("--out", default=None, help="write the JSON report here")


def schedule_steps(cfg, schedule: str, length: int):
    """(fresh carry for `max_seq` tokens, step(params, ids, n_valid, carry) -> carry, finish(params, carry) -> the
    results) of one prefill schedule of a `length`-token prompt, batch 1. Every layer runs whole for every token it
    runs on (`slices.chunk_step`); the head does not run."""
    import jax
    import jax.numpy as jnp

    from dsjax.bench.slices import chunk_step, stream_sum

    forward = chunk_step(cfg)
    exact = jax.jit(lambda p, t, n, s: forward(p, t, s[0], n), donate_argnums=3)  # carry: (state, live)
    if cfg.family != "v4.1":
        from dsjax.state import init_state

        if schedule != "exact":
            raise ConfigError(f"{cfg.name}: V4 prefills with the exact schedule only, not {schedule!r}")
        return (lambda n: (init_state(cfg, 1, n), jnp.zeros((), jnp.float32))), exact, lambda p, s: s
    from dsjax.v41_replay import SCHEDULES, empty_keep, encode_chunk41, replay41, replay_from
    from dsjax.v41_state import init_state41

    if schedule not in SCHEDULES:
        raise ConfigError(f"unknown prefill schedule {schedule!r}; choose from {', '.join(SCHEDULES)}")
    if schedule == "exact":
        return (lambda n: (init_state41(cfg, 1, n), jnp.zeros((), jnp.float32))), exact, lambda p, s: s
    first = replay_from(jnp.asarray([length], jnp.int32), cfg.window_size)

    def step(p, t, n, s):
        return encode_chunk41(p, t, s[0], n, s[1], first, cfg=cfg)

    def finish(p, s):  # the replayed stream too: the last decoder layer whole (see chunk_step)
        y, _, state = replay41(p, s[0], s[1], first, cfg=cfg)
        return state, stream_sum(y)

    return (lambda n: (init_state41(cfg, 1, n), empty_keep(cfg, 1))), step, finish


def prefill_seconds(model, length: int, chunk: int, seed: int = 0, schedule: str = "exact") -> tuple[float, float]:
    """(seconds to prefill `length` random tokens in chunks, seconds of the first chunk incl. compile)."""
    import jax
    import jax.numpy as jnp

    cfg = model.cfg
    init, step, finish = schedule_steps(cfg, schedule, length)
    ids = np.random.default_rng(seed).integers(0, cfg.vocab_size, (1, length)).astype(np.int32)
    dev = jax.devices()[0]
    chunks = [(jax.device_put(jnp.asarray(ids[:, s:s + chunk]), dev),
               jax.device_put(jnp.asarray([min(chunk, length - s)], jnp.int32), dev)) for s in range(0, length, chunk)]
    if chunks[-1][0].shape[1] < chunk:  # a ragged last chunk runs padded, with n_valid saying how much is real
        pad = np.zeros((1, chunk), np.int32)
        pad[:, :chunks[-1][0].shape[1]] = np.asarray(chunks[-1][0])
        chunks[-1] = (jax.device_put(jnp.asarray(pad), dev), chunks[-1][1])

    def fresh():  # committed like the step's outputs, so the jit cache keys the same: one compile
        return jax.device_put(init(-(-length // chunk) * chunk + chunk), dev)

    state = fresh()
    t0 = time.perf_counter()
    state = jax.block_until_ready(finish(model.params, step(model.params, *chunks[0], state)))
    first = time.perf_counter() - t0
    del state
    state = jax.block_until_ready(fresh())
    t0 = time.perf_counter()
    for tokens, n_valid in chunks:
        state = step(model.params, tokens, n_valid, state)
    jax.block_until_ready(finish(model.params, state))
    return time.perf_counter() - t0, first


def nonnegative_fit(X, y) -> tuple[float, float]:
    """Least squares of y ≈ X @ (a, b) with a, b ≥ 0 (two unknowns: the best of the unconstrained fit, if it is
    non-negative, and the two one-term fits) — timing noise must not turn a growing cost into a negative one."""
    (a, b), *_ = np.linalg.lstsq(X, y, rcond=None)
    if a >= 0 and b >= 0:
        return float(a), float(b)
    only = [max(float(X[:, j] @ y / (X[:, j] @ X[:, j])), 0.0) for j in (0, 1)]
    cands = [(only[0], 0.0), (0.0, only[1])]
    return min(cands, key=lambda c: float(np.sum((X @ np.asarray(c) - y) ** 2)))


def one_million(rows, key: str, full_name: str) -> dict:
    """t(S) = a·S + b·S² (a, b ≥ 0) fitted to the full-model times of `rows[...][key]`, evaluated at 1M tokens."""
    S = np.asarray([r["tokens"] for r in rows], np.float64)
    T = np.asarray([r[key]["s"] for r in rows])
    a, b = nonnegative_fit(np.stack([S, S * S], 1), T)
    t1m = a * ONE_M + b * ONE_M ** 2
    return {"tokens": ONE_M, "s_one_gpu_equivalent": t1m, "tokens_per_s": ONE_M / t1m,
            "fit": {"a_s_per_token": a, "b_s_per_token2": b},
            "assumptions": "t(S) = a*S + b*S^2 fitted to the extrapolated full-model times above (linear "
                           "weights term, attention/indexer growing with context); same chunk and kernels; "
                           f"one H200's compute and bandwidth (the full {full_name} weights need more than one: "
                           "divide by the TP speed-up for a real deployment); caches fit."}


def run(args) -> int:
    from dsjax.bench.report import write_report
    from dsjax.bench.roofline import flops_per_token, torch_roofline
    from dsjax.bench.slices import full_config, full_depth, shallower, slice_model

    roof = torch_roofline()
    lengths = [int(x) for x in args.lengths.split(",")]
    schedules = args.schedule.split(",")
    model = slice_model(args.model, kernels=args.kernels, max_seq_len=max(lengths) + args.chunk,
                        reindex_scope=args.reindex_scope)
    cfg = model.cfg
    if cfg.family != "v4.1" and schedules != ["exact"]:
        raise ConfigError(f"--schedule {args.schedule}: V4 models prefill with the exact schedule only")
    full = full_config(cfg)
    depths = {cfg.n_layers: model}
    if args.proxy_layers:
        L1 = cfg.n_layers - args.proxy_layers
        if cfg.family == "v4.1":
            from dsjax.v41_replay import decoder_start

            if L1 != decoder_start(cfg):
                raise ConfigError(f"--proxy-layers {args.proxy_layers}: a V4.1 slice's prefill proxy drops exactly "
                                  f"its {cfg.n_layers - decoder_start(cfg)} decoder layers")
        depths[L1] = shallower(model, L1)
    peak = roof.get("matmul_TFLOPs")
    mfu = lambda flops, secs: flops / secs / (peak * 1e12) if peak else None  # noqa: E731
    name = lambda L, sch: f"slice{L}" + ("" if sch == "exact" else f"-{sch}")  # noqa: E731
    full_key = lambda sch: "full_extrapolated" + ("" if sch == "exact" else f"-{sch}")  # noqa: E731
    rows = []
    for n in lengths:
        row = {"tokens": n, "chunk": args.chunk}
        for L, m in sorted(depths.items()):
            for sch in schedules if L == cfg.n_layers else ["exact"]:  # a shallower V4.1 depth is encoder-only
                secs, first = prefill_seconds(m, n, args.chunk, schedule=sch)
                row[name(L, sch)] = {"s": secs, "tokens_per_s": n / secs, "first_chunk_s": first,
                                     "mfu": mfu(n * flops_per_token(m.cfg, n / 2), secs) if sch == "exact" else None}
                if sch != "exact":
                    row[name(L, sch)]["speedup_vs_exact"] = row[name(L, "exact")]["s"] / secs \
                        if name(L, "exact") in row else None
        if len(depths) == 2:
            L1 = min(depths)
            for sch in schedules:
                t_full = full_depth(cfg, {L1: row[name(L1, "exact")]["s"], cfg.n_layers: row[name(cfg.n_layers, sch)]["s"]})["full"]
                flops = n * flops_per_token(full, n / 2)
                row[full_key(sch)] = {"s": t_full, "tokens_per_s": n / t_full,
                                      "mfu": mfu(flops, t_full) if sch == "exact" else None}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    projection = None
    if len(depths) == 2 and len(rows) >= 2:
        projection = {sch: one_million(rows, full_key(sch), full.name) for sch in schedules}
        if cfg.family != "v4.1":
            projection = projection["exact"]
    report = write_report("prefill", None, args.out, model=model.source, config=cfg.name, roofline=roof, rows=rows,
                          schedules=schedules, one_million=projection,
                          rival={"engine": "rival (V4.1-Flash, 8xB300)", "one_million_s": 11.7, "tokens_per_s": 85000})
    if args.out:
        from dsjax.bench.prefill_plot import plot_prefill

        png = plot_prefill(report, args.out.rsplit(".json", 1)[0] + ".png")
        if png:
            print(f"wrote {png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from dsjax.bench.report import script_main

    raise SystemExit(script_main(__spec__.name))
