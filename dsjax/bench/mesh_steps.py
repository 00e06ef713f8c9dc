"""Step times of a V4-Flash-shaped model at several tensor-parallel degrees, and whether their logits agree.

Real V4-Flash layer shapes and formats (dim 4096, 64 heads x 512, FP8 attention, FP4 experts, the full
vocabulary) with few layers and experts, random weights drawn on the devices. Per TP degree, in one process:
a prefill chunk (tokens/s), and decode steps run inside one on-device `fori_loop` (greedy, host out of the
loop; ms/step). The TP>1 logits and greedy tokens are compared with TP=1's.

    python -m dsjax.bench.mesh_steps --tp 1,2 --layers 4 --experts 16 --batch 4 --out mesh_steps.json
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsjax import sharding
from dsjax.bench.device_weights import device_params
from dsjax.bench.report import write_report
from dsjax.bench.slices import slice_config, state_at
from dsjax.model import forward_chunk
from dsjax.state import init_state
from dsjax.weights import nbytes


def timed(fn, *args, repeats: int = 3):
    out = jax.block_until_ready(fn(*args))  # warm-up / compile
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return out, best


def run_tp(cfg, tp: int, args) -> dict:
    mesh = sharding.make_mesh(tp, 1, jax.devices()[:tp])
    params = device_params(cfg, sharding.param_shardings(cfg, mesh), seed=args.seed)
    rng = np.random.default_rng(args.seed)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, args.prefill)), jnp.int32)
    with jax.set_mesh(mesh):
        prefill = jax.jit(lambda p, t: forward_chunk(p, cfg, t, init_state(cfg, 1, args.max_seq)))
        (logits, _), t_prefill = timed(prefill, params, prompt)

        def decode(p, tok):
            state = state_at(cfg, args.batch, args.max_seq, args.max_seq // 2)

            def body(i, c):
                state, tok, toks = c
                lg, state = forward_chunk(p, cfg, tok[:, None], state)
                tok = jnp.argmax(sharding.gather_vocab(lg[:, 0], cfg.sharding), -1).astype(jnp.int32)
                return state, tok, toks.at[:, i].set(tok)

            toks = jnp.zeros((args.batch, args.steps), jnp.int32)
            return jax.lax.fori_loop(0, args.steps, body, (state, tok, toks))[2]

        first = jnp.argmax(logits[0, -1]).astype(jnp.int32)
        toks, t_decode = timed(jax.jit(decode), params, jnp.full((args.batch,), first, jnp.int32))
    return {"tp": tp, "prefill_tokens": args.prefill, "prefill_s": t_prefill,
            "prefill_tokens_per_s": args.prefill / t_prefill,
            "decode_batch": args.batch, "decode_steps": args.steps, "decode_ms_per_step": 1e3 * t_decode / args.steps,
            "last_logits": np.asarray(logits[0, -1], np.float32), "greedy": np.asarray(toks).tolist()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", default="1,2", help="comma-separated tensor-parallel degrees (each ≤ visible devices)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (kinds cycle window, CSA, HCA)")
    p.add_argument("--experts", type=int, default=16, help="routed experts per layer (V4-Flash has 256)")
    p.add_argument("--batch", type=int, default=4, help="decode batch")
    p.add_argument("--prefill", type=int, default=1024, help="prefill chunk length")
    p.add_argument("--steps", type=int, default=32, help="decode steps inside one on-device loop")
    p.add_argument("--max-seq", type=int, default=8192, help="cache length (decode runs at position max_seq/2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the JSON report here")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    cfg = slice_config(args.layers, args.experts)
    runs = []
    for t in args.tp.split(","):
        runs.append(run_tp(cfg, int(t), args))
        print({k: v for k, v in runs[-1].items() if k not in ("last_logits", "greedy")}, flush=True)
    base = runs[0]
    for r in runs:
        diff = np.abs(r["last_logits"] - base["last_logits"])
        r["logits_max_abs_diff_vs_first"] = float(diff.max())
        r["logits_scale"] = float(np.abs(base["last_logits"]).max())
        r["argmax_equal"] = bool(r["last_logits"].argmax() == base["last_logits"].argmax())
        r["greedy_equal_steps"] = int(np.cumprod(np.all(np.asarray(r["greedy"]) == np.asarray(base["greedy"]),
                                                        axis=0)).sum())
    for r in runs:
        del r["last_logits"]
    write_report("mesh_steps", argv, args.out, config=cfg.name, weight_bytes=nbytes(cfg), runs=runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
