"""`dsjax bench tp`: a layer slice (or the full model) at several tensor-parallel degrees in one process — decode
and verify step time of the real generation loop, prefill tokens/s, the all-reduce time per step, scaling
efficiency against the first degree, and whether the logits and greedy tokens agree across degrees.

Same seed, same weights at every degree (random weights drawn on the devices, partitionable threefry). Per
degree: a prefill chunk (batch 1, best of 3 after a compile), `decode_steps` and `spec_steps` (MTP draft + verify
of k+1, acceptance forced: "simulated") timed at a context through `step_loop.time_loop`, and the collectives of
one compiled decode step, each all-reduce timed alone on the same mesh (`collectives.py`). Beside each step time:
its floor — bytes the step must read (`roofline.step_bytes`) split over the degree, over the copy bandwidth torch
measures in the same run.

    dsjax bench tp --model slice:v4-flash:4 --tp 1,2 --out tp.json
    dsjax bench tp --model slice:v4-flash:43 --tp 2            # full-depth V4-Flash: needs two H200s
    dsjax bench tp --model slice:v4.1-flash:8 --tp 1,2 --k 5   # a V4.1-Flash slice (verify: DSpark's block)
"""

from __future__ import annotations

import contextlib
import gc
import io
import sys
import time

import numpy as np

from dsjax.config import KERNELS_HELP, kernels_arg


def add_args(p) -> None:
    p.add_argument("--model", default="slice:v4-flash:4",
                   help="slice:v4-flash[:LAYERS[:EXPERTS]] (default :4; :43 is the full depth) or "
                        "slice:v4.1-flash[:LAYERS[:EXPERTS]]")
    p.add_argument("--tp", default="1,2", help="comma-separated tensor-parallel degrees, each ≤ visible devices; "
                                               "the first is the baseline of the comparisons (default 1,2)")
    p.add_argument("--batch", type=int, default=1, help="decode / verify batch (default 1)")
    p.add_argument("--context", type=int, default=4096, help="context the steps run at (default 4096)")
    p.add_argument("--k", type=int, default=5, help="draft length of the verify step (default 5; 0 = skip verify)")
    p.add_argument("--acceptance-length", type=float, default=5.6,
                   help="simulated acceptance length of the verify loop (default 5.6, the rival's)")
    p.add_argument("--prefill", type=int, default=4096, help="prefill chunk, batch 1 (default 4096; 0 = skip)")
    p.add_argument("--steps", type=int, default=64, help="timed loop steps (default 64)")
    p.add_argument("--steps-per-dispatch", type=int, default=32, help="loop steps per dispatch (default 32)")
    p.add_argument("--kernels", default="auto", type=kernels_arg, help=KERNELS_HELP)
    p.add_argument("--no-collectives", action="store_true", help="skip the all-reduce accounting (one compile less)")
    p.add_argument("--no-decode", action="store_true",
                   help="skip the plain decode loop (one compile less: a full-depth verify fits one call)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the JSON report here (rewritten after every measurement)")


def _prefill(model, length: int, seed: int) -> dict:
    """Seconds of one prefill chunk of `length` tokens from empty caches; the last position's logits."""
    import jax
    import jax.numpy as jnp

    from dsjax.model import forward_chunk
    from dsjax.state import init_state

    cfg = model.cfg
    ids = jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, (1, length)), jnp.int32)
    with model._on_mesh():
        f = jax.jit(lambda p, t: forward_chunk(p, cfg, t, init_state(cfg, 1, length))[0][:, -1])
        t0 = time.perf_counter()
        logits = jax.block_until_ready(f(model.params, ids))
        first = time.perf_counter() - t0
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            jax.block_until_ready(f(model.params, ids))
            best = min(best, time.perf_counter() - t0)
    return {"prefill_tokens": length, "prefill_s": best, "prefill_tokens_per_s": length / best,
            "prefill_first_call_s": first, "last_logits": np.asarray(jax.device_get(logits[0]), np.float32)}


def _collectives(model, batch: int, ctx: int) -> dict:
    """All-reduces of one compiled decode step (forward of one token per row at `ctx`), timed alone."""
    import jax
    import jax.numpy as jnp

    from dsjax.bench.collectives import collective_ops, time_all_reduces
    from dsjax.bench.slices import state_at
    from dsjax.model import forward_chunk

    cfg = model.cfg
    with model._on_mesh():
        step = jax.jit(lambda p, t, s: forward_chunk(p, cfg, t, s)[0])
        hlo = step.lower(model.params, jnp.zeros((batch, 1), jnp.int32),
                         state_at(cfg, batch, ctx + 128, ctx)).compile().as_text()
    return time_all_reduces(collective_ops(hlo), model.mesh)


def _floor(cfg, copy, tp: int, *, batch: int, ctx: int, k: int, ar_ms: float) -> dict:
    from dsjax.bench.roofline import floor_ms, step_bytes

    sb = step_bytes(cfg, batch=batch, T=k + 1, ctx=ctx, k_draft=k)
    bw = floor_ms(sb["total"], copy, tp=tp)
    return {"step_GB": sb["total"] / 1e9, "floor_ms_bytes": bw,
            "floor_ms_with_all_reduces": None if bw is None else bw + ar_ms}


def measure(spec: str, tp: int, args, copy, save=lambda rec: None) -> dict:
    """One degree's figures; `save(rec)` after each (a run cut short keeps what it measured)."""
    from dsjax.bench.slices import slice_model
    from dsjax.bench.step_loop import time_loop

    t0 = time.perf_counter()
    max_seq = args.context + (args.steps + 4 * args.steps_per_dispatch + 2) * (args.k + 1) + 512
    model = slice_model(spec, kernels=args.kernels, max_seq_len=max(max_seq, args.prefill),
                        max_batch=args.batch, seed=args.seed, tp=tp)
    cfg = model.cfg
    rec: dict = {"tp": tp, "config": cfg.name, "weights_drawn_s": time.perf_counter() - t0}
    def say(what):
        print(f"TP{tp} {what} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        save(rec)

    if args.prefill:
        rec.update(_prefill(model, args.prefill, args.seed))
        say(f"prefill {rec['prefill_tokens_per_s']:,.0f} tokens/s")
    ar_ms = 0.0
    if tp > 1 and not args.no_collectives:
        rec["collectives"] = _collectives(model, args.batch, args.context)
        ar_ms = rec["collectives"]["all_reduce_ms_per_step"]
        say(f"{rec['collectives']['all_reduces']} all-reduces, {ar_ms:.3f} ms per step")
    loop = dict(batch=args.batch, ctx=args.context, steps=args.steps, steps_per_dispatch=args.steps_per_dispatch,
                seed=args.seed)
    if not args.no_decode:
        rec["decode"] = time_loop(model, k=0, keep_tokens=True, **loop)
        rec["decode"].update(_floor(cfg, copy, tp, batch=args.batch, ctx=args.context, k=0, ar_ms=ar_ms))
        say(f"decode {rec['decode']['ms_per_step']:.3f} ms/step")
    if args.k:
        rec["verify"] = time_loop(model, k=args.k, acceptance_length=args.acceptance_length, **loop)
        rec["verify"].update(_floor(cfg, copy, tp, batch=args.batch, ctx=args.context, k=args.k, ar_ms=ar_ms))
        say(f"verify {rec['verify']['ms_per_step']:.3f} ms/step")
    del model
    gc.collect()
    return rec


def compare(runs: list[dict]) -> None:
    """Scaling efficiency and agreement of every degree against the first (in place)."""
    base = runs[0]
    for r in runs:
        for step in ("decode", "verify"):
            if step in r and step in base:
                speedup = base[step]["ms_per_step"] / r[step]["ms_per_step"]
                r[step]["speedup_vs_first"] = speedup
                r[step]["scaling_efficiency"] = speedup * base["tp"] / r["tp"]
        if "prefill_s" in r and "prefill_s" in base:
            r["prefill_scaling_efficiency"] = base["prefill_s"] / r["prefill_s"] * base["tp"] / r["tp"]
        if "last_logits" in r and "last_logits" in base:
            a, b = r["last_logits"], base["last_logits"]
            r["logits"] = {"max_abs_diff_vs_first": float(np.abs(a - b).max()), "scale": float(np.abs(b).max()),
                           "argmax_equal": bool(a.argmax() == b.argmax())}
        if "decode" in r and "decode" in base:
            mine, theirs = np.asarray(r["decode"]["tokens"]), np.asarray(base["decode"]["tokens"])
            n = min(mine.shape[1], theirs.shape[1])
            same = np.all(mine[:, :n] == theirs[:, :n], axis=0)
            r["decode"]["greedy_equal_prefix"] = int(np.cumprod(same).sum())
            r["decode"]["greedy_compared"] = int(n)


def _public(runs: list[dict]) -> list[dict]:
    out = []
    for r in runs:
        r = {k: v for k, v in r.items() if k != "last_logits"}
        if "decode" in r:
            r["decode"] = {k: v for k, v in r["decode"].items() if k != "tokens"}
        out.append(r)
    return out


def run(args) -> int:
    import jax

    from dsjax.bench.report import write_report
    from dsjax.bench.roofline import torch_roofline
    from dsjax.errors import ConfigError

    degrees = [int(t) for t in args.tp.split(",")]
    if max(degrees) > len(jax.devices()):
        raise ConfigError(f"--tp {args.tp} needs {max(degrees)} devices; {len(jax.devices())} are visible")
    roof = torch_roofline()
    runs = []
    def save(partial):
        done = runs + [partial]
        compare(done)
        with contextlib.redirect_stdout(io.StringIO()):  # the full report is printed once, at the end
            write_report("tp", None, args.out, model=args.model, roofline=roof, runs=_public(done))

    for tp in degrees:
        runs.append(measure(args.model, tp, args, roof["copy_GBps"], save))
    compare(runs)
    write_report("tp", None, args.out, model=args.model, roofline=roof, runs=_public(runs))
    return 0


def main(argv=None) -> int:
    from dsjax.bench.report import script_main

    return script_main(__name__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
