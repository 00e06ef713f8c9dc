"""Decode / verify step time of a V4-Flash layer slice with each `kernels` setting, and how far their logits are
apart — the model-level view of `dsjax.bench.kernels` (one GPU).

Real V4-Flash layer shapes and formats (FP8 attention, FP4 experts; window, CSA and HCA layers), random weights
drawn on the device, caches at position `--context`. Each setting runs `--steps` steps of `--chunk` tokens per
slot (1 = decode, k+1 = verify) inside one on-device loop; the first step's logits are compared with `xla`'s.

    python -m dsjax.bench.kernel_steps --layers 3 --experts 64 --batch 32 --chunk 6 --context 65536
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from dsjax import kernel_choice
from dsjax.bench.device_weights import device_params
from dsjax.bench.mesh_steps import timed
from dsjax.bench.slices import slice_config, state_at
from dsjax.bench.report import write_report
from dsjax.model import forward_chunk


def steps(params, cfg, args):
    """(ms per step, first step's logits) for `args.steps` chunks of `args.chunk` tokens per slot."""

    def run(p, tok):
        lg0, state = forward_chunk(p, cfg, tok, state_at(cfg, args.batch, args.max_seq, args.context))

        def body(i, c):
            state, tok = c
            lg, state = forward_chunk(p, cfg, tok, state)
            return state, jnp.argmax(lg, -1).astype(jnp.int32)

        state, tok = jax.lax.fori_loop(0, args.steps - 1, body, (state, jnp.argmax(lg0, -1).astype(jnp.int32)))
        return lg0, tok

    rng = np.random.default_rng(args.seed)
    tok = jnp.asarray(rng.integers(0, cfg.vocab_size, (args.batch, args.chunk)), jnp.int32)
    (lg0, _), t = timed(jax.jit(run), params, tok)
    return 1e3 * t / args.steps, np.asarray(lg0, np.float32)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=3, help="decoder layers (kinds cycle window, CSA, HCA)")
    p.add_argument("--experts", type=int, default=64, help="routed experts per layer (V4-Flash has 256)")
    p.add_argument("--batch", type=int, default=32, help="slots")
    p.add_argument("--chunk", type=int, default=6, help="tokens per slot per step (1 decode, k+1 verify)")
    p.add_argument("--context", type=int, default=65536, help="cache position of the steps")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--kernels", default="xla,auto,pallas")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    args.max_seq = args.context + args.chunk * args.steps + 128
    base = slice_config(args.layers, args.experts)
    params = device_params(base, _single_device(base), seed=args.seed)
    runs, ref = [], None
    for mode in args.kernels.split(","):
        ms, lg = steps(params, base.replace(kernels=mode), args)
        rec = {"kernels": mode, "ms_per_step": ms, "tokens_per_step": args.batch * args.chunk}
        if ref is None:
            ref = lg
        rec["logits_max_abs_diff_vs_first"] = float(np.abs(lg - ref).max())
        rec["logits_scale"] = float(np.abs(ref).max())
        rec["argmax_agree"] = float(np.mean(lg.argmax(-1) == ref.argmax(-1)))
        runs.append(rec)
        print(json.dumps(rec), flush=True)
    write_report("kernel_steps", argv, args.out, config=base.name, args=vars(args), runs=runs,
                 choices=kernel_choice.choices())
    return 0


def _single_device(cfg):
    from dsjax import sharding
    return sharding.param_shardings(cfg, sharding.make_mesh(1, 1, jax.devices()[:1]))


if __name__ == "__main__":
    raise SystemExit(main())
