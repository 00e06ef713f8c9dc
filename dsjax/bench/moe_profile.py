"""Where one MoE expert GEMM call's device time goes: every kernel of the call — the two grouped-GEMM kernels and
the small XLA kernels around them (routing sort, tile map, SwiGLU, scatter) — from a JAX profiler trace, with
XLA's command buffers off so each kernel shows by its HLO name. How the tile map's ~30 µs searchsorted loop was
found (docs/benchmarks.md, "MoE expert GEMM").

    python -m dsjax.bench.moe_profile --tokens 1,8 --format fp4 --configs '[{}, {"block_m": 1}]'
    python -m dsjax.bench.moe_profile --tokens 1 --dump /tmp/moe-dump      # + each kernel's dsjax source line

Prints per configuration the total device time per call and the kernels by time; --out writes it as JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys


def main(argv=None) -> int:
    from dsjax.bench.kernels import moe_option_list, token_counts
    from dsjax.bench.profile import kernel_times

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default=[1, 8], type=token_counts, help="token counts (comma-separated, default 1,8)")
    p.add_argument("--format", default="fp4", choices=("fp4", "fp8", "bf16"), help="expert weight format")
    p.add_argument("--configs", default="[{}]", type=moe_option_list,
                   help="JSON list of Pallas kernel options (moe_gemm keywords), one profile each")
    p.add_argument("--implementation", default="pallas", choices=("pallas", "xla"))
    p.add_argument("--activations", default="fp8", choices=("fp8", "bf16"),
                   help="fp8: x and h fake-quantized (reference-fp8 numerics, the FP8 tensor-core kernels); bf16")
    p.add_argument("--reps", type=int, default=20, help="calls traced per configuration")
    p.add_argument("--top", type=int, default=12, help="kernels printed per configuration")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, interpreted kernels (a CPU check)")
    p.add_argument("--out", default=None, help="write the per-kernel times here (JSON)")
    p.add_argument("--dump", default=None, help="dump XLA's optimised HLO here and name each kernel's dsjax source "
                   "line (a fresh process: the flag must reach XLA before its first compile)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    tokens = args.tokens
    if args.reps < 1:
        p.error("--reps must be positive")
    # each kernel under its own name: XLA's command buffers would fold the glue into one event
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="
    if args.dump:
        os.environ["XLA_FLAGS"] += f" --xla_dump_to={args.dump} --xla_dump_hlo_as_text"

    import jax
    from dsjax.bench.kernels import expert_stack, moe_routing, moe_shapes
    from dsjax.bench.report import run_info
    from dsjax.kernels import moe_gemm

    E, D, I, k = moe_shapes(args.smoke)
    keys = jax.random.split(jax.random.key(2), 3)
    lins = [expert_stack(keys[0], E, I, D, args.format), expert_stack(keys[1], E, I, D, args.format),
            expert_stack(keys[2], E, D, I, args.format)]
    configs = args.configs if args.implementation == "pallas" else [{}]
    report = dict(run_info("moe_profile", sys.argv[1:] if argv is None else argv), shapes=dict(E=E, D=D, I=I, k=k),
                  profiles=[])
    for n in tokens:
        x, w, ids = moe_routing(n, E, D, k)
        for cfg in configs:
            extra = dict(interpret=True) if args.smoke and args.implementation == "pallas" else {}
            fn = jax.jit(functools.partial(moe_gemm.moe_gemm, swiglu_limit=10.0,
                                           act_quant_sim=args.activations == "fp8",
                                           act_quant_block=128, implementation=args.implementation, **cfg, **extra))
            times, where = kernel_times(fn, (x, w, ids, *lins), args.reps, args.dump)
            total = sum(times.values())
            report["profiles"].append(dict(tokens=n, options=cfg, us_per_call=total, kernels=times,
                                           **(dict(sources=where) if args.dump else {})))
            print(f"{n} tokens, {args.format}, {args.implementation} {json.dumps(cfg)}: {total:.1f} µs a call, "
                  f"{len(times)} kernels")
            for name, us in list(times.items())[:args.top]:
                print(f"  {us:9.1f} µs  {name}" + (f"  ({where[name]})" if args.dump else ""))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
