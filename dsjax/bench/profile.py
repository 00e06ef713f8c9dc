"""Where a layer step's device time goes: JAX profiler traces of a slice's decode step, verify step and prefill
chunk, every GPU kernel's time attributed to the line of dsjax that made it. The input to issue 9's fusions.

    XLA_FLAGS="--xla_dump_to=DUMP --xla_dump_hlo_as_text" \\
        python -m dsjax.bench.profile --model slice:v4-flash:2 --out-dir prof --dump DUMP

Traces go to OUT/{decode,verify,prefill}/ (TensorBoard / Perfetto); the summary, OUT/profile.json and
OUT/profile.md, lists per step kind the kernels by total time and the time per dsjax source file and line.
Kernels are matched to HLO instructions by name in the optimised HLO that XLA dumps (`--dump`), whose metadata
holds the source line; without a dump only kernel names are listed. XLA's command buffers are off in this
process (`no_command_buffers`), so every kernel is its own event.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

from dsjax.config import KERNELS_HELP, kernels_arg

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = .*?metadata=\{([^}]*)\}")
_META = re.compile(r'(\w+)="?([^"\s]*)"?')
_ENTRY = re.compile(r"^(\d+) (.*)$")
_HELPERS = ("numerics.py", "layers/linear.py", "layers/rows.py")   # called from everywhere: name the caller


def _frames(lines: list[str]) -> dict[int, list[tuple[str, int, str]]]:
    """The optimised HLO text's stack-frame tables -> frame id -> dsjax call sites, innermost first."""
    sec, files, funcs, locs, parents = None, {}, {}, {}, {}
    for line in lines:
        if line.strip() in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            sec = line.strip()
            continue
        m = _ENTRY.match(line.strip()) if sec else None
        if not m:
            continue
        i, rest = int(m.group(1)), m.group(2)
        if sec in ("FileNames", "FunctionNames"):
            (files if sec == "FileNames" else funcs)[i] = rest.strip('"')
        else:
            kv = dict(re.findall(r"(\w+)=(\d+)", rest))
            if sec == "FileLocations":
                locs[i] = (files.get(int(kv["file_name_id"]), "?"), int(kv["line"]), funcs.get(int(kv["function_name_id"]), "?"))
            else:   # parent_frame_id prints one above the parent's id (0 = none)
                parents[i] = (int(kv["file_location_id"]), int(kv["parent_frame_id"]) - 1)
    out = {}
    for fid in parents:
        chain, seen, f = [], set(), fid
        while f in parents and f not in seen:
            seen.add(f)
            loc, f = parents[f]
            file, line, fn = locs.get(loc, ("?", 0, "?"))
            if "dsjax/" in file or "pallas_kernels/" in file:
                short = re.split(r"dsjax/|pallas_kernels/", file, maxsplit=1)[-1]
                if not short.startswith("bench/"):
                    chain.append((short, line, fn))
        out[fid] = chain
    return out


def hlo_sources(dump_dir: str | None) -> dict[tuple[str, str], dict]:
    """(HLO module, instruction name) -> {op_name, source: the innermost dsjax call site that is not a generic
    helper, chain: the dsjax functions around it}, from every optimised module XLA dumped (later compiles of a
    module name win). Kernels are named after instructions ('.' may read '_')."""
    out: dict[tuple[str, str], dict] = {}
    paths = sorted(glob.glob(os.path.join(dump_dir, "*after_optimizations.txt"))) if dump_dir else []
    for path in paths:
        module = os.path.basename(path).split(".")[1]
        with open(path) as f:
            lines = f.read().splitlines()
        frames = _frames(lines)
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            meta = dict(_META.findall(m.group(2)))
            chain = frames.get(int(meta.get("stack_frame_id", 0) or 0), [])
            main = next((c for c in chain if not c[0].endswith(_HELPERS)), chain[0] if chain else None)
            info = {"op_name": meta.get("op_name", ""),
                    "source": f"{main[0]}:{main[1]} {main[2]}" if main else "?",
                    "chain": " < ".join(f"{c[2]}" for c in chain[:4])}
            for name in {m.group(1), m.group(1).replace(".", "_").replace("-", "_")}:
                out[(module, name)] = info
    return out


def trace_events(trace_dir: str) -> list[dict]:
    """Complete ('X') events on GPU device tracks of the Perfetto trace JAX wrote under trace_dir (on a CPU
    backend: the thunk events that name their HLO op)."""
    files = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not files:
        return []
    with gzip.open(sorted(files)[-1]) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    gpu = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
           and "GPU" in str(e.get("args", {}).get("name", ""))}
    if gpu:
        return [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu]
    return [e for e in events if e.get("ph") == "X" and "hlo_op" in e.get("args", {})]


def kernel_name(event: dict) -> str:
    """A trace event's kernel: the HLO instruction it names when it names one, else the event's own name."""
    return event.get("args", {}).get("hlo_op") or event["name"]


def kernel_totals(events: list[dict]) -> collections.Counter:
    """µs per kernel name, summed over the events."""
    totals = collections.Counter()
    for e in events:
        totals[kernel_name(e)] += float(e.get("dur", 0.0))
    return totals


def source_of(sources: dict, module: str, name: str) -> dict:
    """`hlo_sources`' entry for kernel `name` of HLO module `module` ({} when the dump does not name it)."""
    return sources.get((module, name)) or sources.get((module, name.split(".")[0])) or {}


def kernel_times(fn, args, reps: int, dump: str | None = None) -> tuple[dict[str, float], dict[str, str]]:
    """µs per call of each kernel (by HLO name) over `reps` traced calls of the jitted fn, and with `dump` (the
    directory XLA dumped the optimised HLO into) each kernel's dsjax source line (`hlo_sources`)."""
    import jax

    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(reps):
                out = fn(*args)
            jax.block_until_ready(out)
        events = trace_events(d)
    times = {name: us / reps for name, us in kernel_totals(events).most_common()}
    if not dump:
        return times, {}
    sources, modules = hlo_sources(dump), {kernel_name(e): e.get("args", {}).get("hlo_module", "") for e in events}
    return times, {name: source_of(sources, modules[name], name).get("source", "?") for name in times}


def attribute(events: list[dict], sources: dict[str, dict], steps: int) -> dict:
    """Per kernel name and per source line: total µs per step, share of the device time."""
    by_kernel = kernel_totals(events)
    args_of = {}
    for e in events:
        args_of.setdefault(kernel_name(e), e.get("args", {}))
    total = sum(by_kernel.values()) or 1.0
    by_line = collections.Counter()
    by_file = collections.Counter()
    kernels = []
    for name, us in by_kernel.most_common():
        module = args_of[name].get("hlo_module", "")
        meta = source_of(sources, module, name)
        where = meta.get("source", "?")
        by_line[where] += us
        by_file[where.split(":")[0]] += us
        kernels.append({"kernel": name, "module": module, "us_per_step": us / steps, "share": us / total,
                        "source": where, "chain": meta.get("chain", ""), "op_name": meta.get("op_name", "")[-160:]})
    return {"device_us_per_step": total / steps, "kernels_per_step": len(events) / steps,
            "kernels": kernels[:60],
            "by_line": [{"source": k, "us_per_step": v / steps, "share": v / total} for k, v in by_line.most_common(40)],
            "by_file": [{"source": k, "us_per_step": v / steps, "share": v / total} for k, v in by_file.most_common()]}


def profile_loop(model, out_dir: str, *, k: int, context: int, steps: int) -> int:
    """Trace `steps` decode (k=0) or verify (k>0, every draft accepted: simulated) steps; returns steps traced."""
    import jax

    from dsjax.bench.step_loop import time_loop

    kw = dict(batch=1, ctx=context, k=k, steps=steps, steps_per_dispatch=steps)
    time_loop(model, **kw)                                   # compile outside the trace
    with jax.profiler.trace(out_dir, create_perfetto_trace=True):
        rec = time_loop(model, **kw)
    return int(rec["steps"]) + 2 * steps                     # time_loop's two warm-up dispatches are traced too


def profile_prefill(model, out_dir: str, *, chunk: int, context: int, reps: int = 3) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dsjax.bench.slices import chunk_step, state_at

    cfg = model.cfg
    dev = jax.devices()[0]
    step = jax.jit(chunk_step(cfg))  # every layer whole, no head (as `bench prefill` times a chunk)
    state = jax.device_put(state_at(cfg, 1, context + chunk, context - chunk), dev)
    ids = jax.device_put(jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, chunk)), jnp.int32), dev)
    jax.block_until_ready(step(model.params, ids, state))
    with jax.profiler.trace(out_dir, create_perfetto_trace=True):
        for _ in range(reps):
            jax.block_until_ready(step(model.params, ids, state))
    return reps


def no_command_buffers() -> None:
    """Turn XLA's command buffers (CUDA graphs) off for this process unless XLA_FLAGS says otherwise: inside one,
    a trace shows a single `command_buffer_N` event for all its kernels, which names no source. Call before JAX
    starts its GPU backend."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_enable_command_buffer" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_gpu_enable_command_buffer=").strip()


def markdown(report: dict) -> str:
    lines = [f"# Profile of {report['model']} ({report['kernels']} kernels), {report['date']}", ""]
    for kind, r in report["steps"].items():
        lines += [f"## {kind}: {r['device_us_per_step']:.0f} µs of kernels per step, {r['kernels_per_step']:.0f} "
                  f"kernels ({r['what']})", "", "| source | µs/step | share |", "|---|---:|---:|"]
        lines += [f"| {x['source']} | {x['us_per_step']:.1f} | {100 * x['share']:.1f}% |" for x in r["by_line"][:20]]
        lines += ["", "| file | µs/step | share |", "|---|---:|---:|"]
        lines += [f"| {x['source']} | {x['us_per_step']:.1f} | {100 * x['share']:.1f}% |" for x in r["by_file"]]
        lines += ["", "| kernel | µs/step | share | source | calls |", "|---|---:|---:|---|---|"]
        lines += [f"| `{x['kernel'][:60]}` | {x['us_per_step']:.1f} | {100 * x['share']:.1f}% | {x['source']} | {x['chain']} |"
                  for x in r["kernels"][:25]]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="slice:v4-flash:2", help="slice:v4-flash[:LAYERS[:EXPERTS]]")
    p.add_argument("--kernels", default="auto", type=kernels_arg, help=KERNELS_HELP)
    p.add_argument("--reindex-scope", default="all", choices=("all", "candidates"),
                   help="V4.1 Reindex layers: score every key and mask ('all', the default) or only the candidate positions ('candidates'): the same picks, less work at long context")
    p.add_argument("--context", type=int, default=4096, help="context of the decode / verify steps")
    p.add_argument("--k", type=int, default=5, help="draft length of the verify step (0: skip it)")
    p.add_argument("--steps", type=int, default=16, help="loop steps traced per dispatch (0: skip the decode and verify steps)")
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk traced (0: skip)")
    p.add_argument("--prefill-context", type=int, default=8192, help="position the prefill chunk ends at")
    p.add_argument("--dump", default=None, help="the --xla_dump_to directory of this run (source attribution)")
    p.add_argument("--out-dir", default="profile")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    no_command_buffers()

    from dsjax.bench.report import run_info
    from dsjax.bench.slices import slice_model

    os.makedirs(args.out_dir, exist_ok=True)
    model = slice_model(args.model, kernels=args.kernels, max_seq_len=max(args.context, args.prefill_context) + 512,
                        reindex_scope=args.reindex_scope)
    report = dict(run_info("profile", argv), model=args.model, kernels=args.kernels, steps={})
    plan = []
    if args.steps:
        plan.append(("decode", lambda d: profile_loop(model, d, k=0, context=args.context, steps=args.steps),
                     f"batch 1, context {args.context}"))
    if args.steps and args.k:
        plan.append(("verify", lambda d: profile_loop(model, d, k=args.k, context=args.context, steps=args.steps),
                     f"MTP k={args.k} draft + verify of {args.k + 1}, every draft accepted (simulated), context {args.context}"))
    if args.chunk:
        plan.append(("prefill", lambda d: profile_prefill(model, d, chunk=args.chunk, context=args.prefill_context),
                     f"one {args.chunk}-token chunk ending at {args.prefill_context}"))
    for kind, run, what in plan:
        d = os.path.join(args.out_dir, kind)
        t0 = time.perf_counter()
        n = run(d)
        r = attribute(trace_events(d), hlo_sources(args.dump), n)
        r.update(what=what, steps_traced=n, wall_s=time.perf_counter() - t0)
        report["steps"][kind] = r
        print(json.dumps({kind: {x: r[x] for x in ("device_us_per_step", "kernels_per_step")},
                          "top": r["by_line"][:8]}), flush=True)
        with open(os.path.join(args.out_dir, "profile.json"), "w") as f:
            json.dump(report, f, indent=1)
        with open(os.path.join(args.out_dir, "profile.md"), "w") as f:
            f.write(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
