"""`dsjax bench ablate`: step time of the real generation loop as one setting at a time moves away from a
baseline — kernels, draft length k, steps per dispatch (the host's share), context, batch — each beside its
roofline (bytes the step must read over the copy bandwidth measured in the same run), and the layer-slice proxy:
per-layer decode / verify time from two slice depths and the full model's step, extrapolated and labelled.

Every sweep writes `ablate-<sweep>.json` into `--out-dir`; the tables (`ablate.md`) and PNG plots are rebuilt
from every JSON there, so sweeps run in separate calls add up. Speculative steps use forced acceptance
("simulated"): per-draft acceptance `--alpha`, i.e. acceptance length (1 - alpha^(k+1)) / (1 - alpha).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import sys

from dsjax.config import kernels_arg

SWEEPS = ("proxy", "kernels", "k", "dispatch", "context", "batch")
AXIS = {"kernels": "kernels", "k": "k", "dispatch": "steps_per_dispatch", "context": "context", "batch": "batch"}


def add_args(p) -> None:
    p.add_argument("--model", default="slice:v4-flash:4",
                   help="slice:v4-flash[:LAYERS[:EXPERTS]] (default slice:v4-flash:4), a checkpoint or a preset")
    p.add_argument("--sweeps", default=",".join(SWEEPS), help=f"comma-separated, from {', '.join(SWEEPS)}")
    p.add_argument("--batch", type=int, default=1, help="baseline batch (default 1)")
    p.add_argument("--context", type=int, default=4096, help="baseline context (default 4096)")
    p.add_argument("--k", type=int, default=5, help="baseline draft length (default 5; 0 = plain decode)")
    p.add_argument("--alpha", type=float, default=0.97,
                   help="simulated per-draft acceptance (default 0.97: acceptance length 5.57 at k=5)")
    p.add_argument("--steps-per-dispatch", type=int, default=32, help="baseline steps per dispatch (default 32)")
    p.add_argument("--kernels", default="auto", type=kernels_arg,
                   help="baseline kernels: auto | xla | pallas, then optional per-op overrides (auto+moe_gemm=xla)")
    p.add_argument("--numerics", default=None, choices=["transformers", "reference-bf16", "reference-fp8"],
                   help="a slice's numerics (default: the slice config's, bf16 activations); reference-fp8 rounds "
                        "activations to FP8 as DeepSeek's reference does, which lets the MoE kernels run on FP8 "
                        "tensor cores")
    p.add_argument("--steps", type=int, default=64, help="timed steps per point (default 64)")
    p.add_argument("--values", action="append", default=[], metavar="SWEEP=V1,V2",
                   help="override a sweep's values, e.g. context=1024,8192 (repeatable)")
    p.add_argument("--proxy-layers", type=int, default=2,
                   help="proxy: the shallower slice has this many fewer layers (default 2: one CSA/HCA pair)")
    p.add_argument("--out-dir", default="ablate-out", help="JSON, ablate.md and PNGs go here (default ablate-out)")
    p.add_argument("--profile-dir", default=None, help="write a JAX profiler trace of the baseline point here")


DEFAULT_VALUES = {"kernels": ["xla", "auto", "pallas"], "k": [0, 1, 3, 5], "dispatch": [1, 8, 32],
                  "context": [1024, 4096, 32768, 131072], "batch": [1, 4, 16]}
_MEMO: dict = {}  # one measurement per setting and model within a run: sweeps share their baseline point


def acceptance_length(k: int, alpha: float) -> float:
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def _values(args) -> dict:
    vals = {k: list(v) for k, v in DEFAULT_VALUES.items()}
    for item in args.values:
        name, _, rest = item.partition("=")
        if name not in vals:
            raise SystemExit(f"error: --values names an unknown sweep {name!r}")
        vals[name] = [x if name == "kernels" else int(x) for x in rest.split(",")]
    return vals


def _model(args):
    from dsjax.bench.slices import slice_model

    if args.model.startswith("slice:"):
        return slice_model(args.model, kernels=args.kernels, max_seq_len=8192, max_batch=64,
                           numerics=args.numerics), True
    import dsjax

    return dsjax.load(args.model, kernels=args.kernels), False


def point(model, roof, *, batch, context, k, alpha, steps_per_dispatch, steps, kernels, profile_dir=None) -> dict:
    """One timed setting, with the roofline of the same step."""
    from dsjax.bench.roofline import floor_ms, step_bytes
    from dsjax.bench.step_loop import time_loop

    key = (model.cfg.name, batch, context, k, alpha, steps_per_dispatch, steps, kernels)
    if key in _MEMO and not profile_dir:
        return dict(_MEMO[key])

    m = dataclasses.replace(model, cfg=model.cfg.replace(kernels=kernels))
    al = acceptance_length(k, alpha) if k else None
    if profile_dir:
        import jax

        time_loop(m, batch=batch, ctx=context, k=k, acceptance_length=al, steps=steps,
                  steps_per_dispatch=steps_per_dispatch)  # compile outside the trace
        with jax.profiler.trace(profile_dir):
            rec = time_loop(m, batch=batch, ctx=context, k=k, acceptance_length=al, steps=steps,
                            steps_per_dispatch=steps_per_dispatch)
    else:
        rec = time_loop(m, batch=batch, ctx=context, k=k, acceptance_length=al, steps=steps,
                        steps_per_dispatch=steps_per_dispatch)
    b = step_bytes(m.cfg, batch=batch, T=k + 1, ctx=context, k_draft=k)
    fl = floor_ms(b["total"], roof.get("copy_GBps"))
    rec.update(bytes=b, floor_ms=fl, fraction_of_floor=(fl / rec["ms_per_step"]) if fl else None)
    print(json.dumps({x: rec[x] for x in ("kernels", "batch", "context", "k", "steps_per_dispatch", "ms_per_step",
                                          "floor_ms")}), file=sys.stderr, flush=True)
    _MEMO[key] = dict(rec)
    return rec


def proxy(model, roof, args) -> dict:
    """Per-layer decode (k=0) and verify (baseline k) step time from the slice and its first L - proxy_layers
    layers (same weights; V4.1: 3, its encoder layers and all, for a per-kind fit), and the full model's step
    extrapolated, beside the full model's roofline."""
    from dsjax.bench.roofline import floor_ms, step_bytes
    from dsjax.bench.slices import full_config, full_depth, proxy_depths, shallower

    cfg = model.cfg
    depths = proxy_depths(cfg, cfg.n_layers - args.proxy_layers)
    models = {L: model if L == cfg.n_layers else shallower(model, L) for L in depths}
    full = full_config(cfg)
    drafter = "DSpark" if cfg.family == "v4.1" else "MTP"
    rows = []
    for k in sorted({0, args.k}):
        t = {L: point(m, roof, batch=args.batch, context=args.context, k=k, alpha=args.alpha,
                      steps_per_dispatch=args.steps_per_dispatch, steps=args.steps, kernels=args.kernels)["ms_per_step"]
             for L, m in models.items()}
        fit = full_depth(cfg, t)
        ms_full = fit["full"]
        b = step_bytes(full, batch=args.batch, T=k + 1, ctx=args.context, k_draft=k)
        fl = floor_ms(b["total"], roof.get("copy_GBps"))
        al = acceptance_length(k, args.alpha) if k else 1.0
        rows.append({"k": k, "step": "decode" if k == 0 else f"verify {k + 1} ({drafter} draft k={k})",
                     "slice_ms": {str(L): v for L, v in t.items()},
                     "per_layer_ms": fit["per_layer"], "full_ms_extrapolated": ms_full, "full_floor_ms": fl,
                     "full_bytes": b, "fraction_of_floor": fl / ms_full if fl else None,
                     "acceptance_length": al, "acceptance": "simulated" if k else None,
                     "full_tokens_per_s_extrapolated": 1e3 * al * args.batch / ms_full})
    return {"label": f"layer-slice proxy: full-model figures extrapolated ({fit['method']})", "layers": depths,
            "full_layers": full.n_layers, "rows": rows}


def run(args) -> int:
    from dsjax.bench.report import run_info
    from dsjax.bench.roofline import torch_roofline

    sweeps = [s for s in args.sweeps.split(",") if s]
    bad = [s for s in sweeps if s not in SWEEPS]
    if bad:
        print(f"error: unknown sweep(s) {', '.join(bad)}; choose from {', '.join(SWEEPS)}", file=sys.stderr)
        return 2
    roof = torch_roofline()
    model, _ = _model(args)
    vals = _values(args)
    os.makedirs(args.out_dir, exist_ok=True)
    base = dict(batch=args.batch, context=args.context, k=args.k, alpha=args.alpha,
                steps_per_dispatch=args.steps_per_dispatch, steps=args.steps, kernels=args.kernels)
    for sweep in sweeps:
        info = {**run_info("ablate", None), "model": model.source, "config": model.cfg.name,
                "numerics": model.cfg.numerics, "roofline": roof,
                "baseline": base, "sweep": sweep}
        if sweep == "proxy":
            info["proxy"] = proxy(model, roof, args)
        else:
            pts = []
            for v in vals[sweep]:
                kw = dict(base, **{AXIS[sweep]: v})
                prof = args.profile_dir if (sweep == sweeps[-1] and v == vals[sweep][0]) else None
                pts.append(point(model, roof, profile_dir=prof, **kw))
            info["axis"], info["points"] = AXIS[sweep], pts
        with open(os.path.join(args.out_dir, f"ablate-{sweep}.json"), "w") as f:
            json.dump(info, f, indent=1)
    write_tables_and_plots(args.out_dir)
    print(f"wrote {args.out_dir}/ablate.md and its plots", file=sys.stderr)
    return 0


def _load_all(out_dir: str) -> dict:
    res = {}
    for path in sorted(glob.glob(os.path.join(out_dir, "ablate-*.json"))):
        with open(path) as f:
            d = json.load(f)
        res[d["sweep"]] = d
    return res


def _fmt(x, nd=2):
    return "—" if x is None else f"{x:,.{nd}f}"


def write_tables_and_plots(out_dir: str) -> str:
    """ablate.md (one table per sweep, with each run's command, machine, versions and date) and one PNG per
    sweep, from the ablate-*.json in `out_dir`."""
    res = _load_all(out_dir)
    lines = ["# Step-time ablations", "",
             "Generated by `dsjax bench ablate` from the JSON beside this file. Random weights; speculative steps "
             "use forced acceptance (**simulated**). Floor = bytes the step must read / copy bandwidth measured "
             "in the same run.", ""]
    for sweep in SWEEPS:
        d = res.get(sweep)
        if d is None:
            continue
        roof = d.get("roofline", {})
        lines += [f"## {sweep}", "", f"`{d['command']}` — {d['machine']}, JAX {d['jax']}, {d['date']}; "
                  f"{d['model']}; copy {_fmt(roof.get('copy_GBps'), 0)} GB/s; baseline {d['baseline']}", ""]
        if sweep == "proxy":
            p = d["proxy"]
            depths = " / ".join(str(L) for L in p["layers"])
            lines += [f"{p['label']}; slices of {depths} layers, full model {p['full_layers']} layers.", "",
                      f"| step | slice ms ({depths} layers) | per layer ms | full step ms (extrapolated) | "
                      "full floor ms | of floor | full tokens/s (extrapolated) |", "|---|---|---|---|---|---|---|"]
            for r in p["rows"]:
                s, per = r["slice_ms"], r["per_layer_ms"]
                per = " / ".join(f"{kind} {_fmt(v, 3)}" for kind, v in per.items()) if isinstance(per, dict) \
                    else _fmt(per, 3)
                lines.append(f"| {r['step']} | {' / '.join(_fmt(v) for v in s.values())} | {per}"
                             f" | {_fmt(r['full_ms_extrapolated'])} | {_fmt(r['full_floor_ms'])} | "
                             f"{_fmt(100 * r['fraction_of_floor'], 0) + '%' if r['fraction_of_floor'] else '—'} | "
                             f"{_fmt(r['full_tokens_per_s_extrapolated'], 0)} |")
        else:
            lines += [f"| {d['axis']} | ms/step | floor ms | of floor | tokens/s (slice) | first dispatch s |",
                      "|---|---|---|---|---|---|"]
            for r in d["points"]:
                frac = r.get("fraction_of_floor")
                lines.append(f"| {r[d['axis']]} | {_fmt(r['ms_per_step'])} | {_fmt(r.get('floor_ms'))} | "
                             f"{_fmt(100 * frac, 0) + '%' if frac else '—'} | {_fmt(r['tokens_per_s'], 0)} | "
                             f"{_fmt(r['first_dispatch_s'], 1)} |")
            png = _plot(d, out_dir)
            if png:
                lines += ["", f"![{sweep}]({os.path.basename(png)})"]
        lines.append("")
    path = os.path.join(out_dir, "ablate.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


def _plot(d: dict, out_dir: str) -> str | None:
    from dsjax.bench.report import pyplot

    plt = pyplot()
    if plt is None:
        return None
    axis = d["axis"]
    xs = [str(r[axis]) for r in d["points"]]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(xs, [r["ms_per_step"] for r in d["points"]], "o-", label="measured")
    if any(r.get("floor_ms") for r in d["points"]):
        ax.plot(xs, [r.get("floor_ms") or float("nan") for r in d["points"]], "s--", label="bandwidth floor")
    ax.set_xlabel(axis)
    ax.set_ylabel("ms per step")
    ax.set_title(f"{d['sweep']}: {d['config']} ({d['machine']})", fontsize=9)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(out_dir, f"ablate-{d['sweep']}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    from dsjax.bench.report import script_main

    raise SystemExit(script_main(__spec__.name))
