"""`dsjax plan`: per-device memory of a deployment (weights, decode state, workspace) and whether it fits."""

from __future__ import annotations

import json


def add_plan_parser(sub) -> None:
    p = sub.add_parser(
        "plan", help="per-device memory of a model on a dp x tp mesh, and whether it fits H200 / B200 / B300",
        description="Per-device memory of serving a model on a (dp, tp) mesh: weights by category (from the "
                    "sharding rules), decode state (from init_state's shapes), an estimated workspace, the KV "
                    "layout actually allocated, and whether it fits an H200, B200 or B300 under JAX's memory "
                    "policy (XLA_PYTHON_CLIENT_MEM_FRACTION, default 0.75 of device memory). Nothing is "
                    "allocated: it runs on a laptop.")
    p.add_argument("--model", default="v4-flash",
                   help="preset name (v4-flash, v4-flash-0731, v4.1-flash, tiny-v4), the bundled dsjax-small, or a "
                        "config.json / checkpoint / Orbax directory (default: v4-flash)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree: devices that split heads, vocab, shared expert (and experts); default 1")
    p.add_argument("--dp", type=int, default=1, help="data-parallel degree: devices that split the batch slots; default 1")
    p.add_argument("--ep", default="tp",
                   help="routed experts over 'tp' (each tp group holds all experts) or 'all' devices (dp x tp); "
                        "a number must equal tp or dp*tp (default: tp)")
    p.add_argument("--max-seq-len", type=int, default=4096, help="tokens per sequence the caches hold (default 4096)")
    p.add_argument("--batch", type=int, default=8,
                   help="concurrent sequences (generate rounds it up to a power of two, at least dp; default 8)")
    p.add_argument("--numerics", default=None, choices=["transformers", "reference-bf16", "reference-fp8"],
                   help="numeric preset (default: the model's, reference-bf16); 'transformers' keeps fp32 caches")
    p.add_argument("--mem-fraction", type=float, default=None,
                   help="share of device memory JAX may use (default: $XLA_PYTHON_CLIENT_MEM_FRACTION, else 0.75)")
    p.add_argument("--json", action="store_true", help="print one JSON object (bytes as integers) instead of a table")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args) -> int:
    from dsjax.plan import format_plan, plan

    result = plan(args.model, tp=args.tp, dp=args.dp, ep=args.ep, max_seq_len=args.max_seq_len, batch=args.batch,
                  numerics=args.numerics, mem_fraction=args.mem_fraction)
    print(json.dumps(result, indent=1) if args.json else format_plan(result))
    return 0
