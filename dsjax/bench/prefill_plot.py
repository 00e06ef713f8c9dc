"""Plots of a `dsjax bench prefill` report: prompt tokens/s per prompt length for every timed series (slice depths,
schedules, the full model extrapolated), and the 1M-token projection t(S) = a·S + b·S² through the full-model
points, with the rival's 11.7 s beside it. Written next to the JSON by the benchmark; this module also redraws
one from saved reports (rows of several runs are merged, later runs winning per length):

    python -m dsjax.bench.prefill_plot REPORT.json [MORE.json ...] --out prefill.png [--json merged.json]

Lengths timed in separate runs (a per-call time limit) get one 1M fit this way.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

ONE_M = 1 << 20
B300X8_IN_H200S = 18   # dense compute: a B300 ~2.3x an H200 (~4.5 vs ~2 PFLOP/s FP8), x 8 (specdec-and-perf.md §3)


def series(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """{series name: [(tokens, tokens/s), ...]} over the rows, in prompt-length order."""
    out: dict[str, list[tuple[int, float]]] = {}
    for r in sorted(rows, key=lambda r: r["tokens"]):
        for key, v in r.items():
            if isinstance(v, dict) and "tokens_per_s" in v:
                out.setdefault(key, []).append((r["tokens"], v["tokens_per_s"]))
    return out


def plot_prefill(report: dict, path: str) -> str | None:
    """PNG at `path` (None when matplotlib is missing)."""
    from dsjax.bench.report import pyplot

    plt = pyplot()
    if plt is None:
        return None
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, pts in series(report["rows"]).items():
        xs, ys = zip(*pts)
        ax.plot(xs, ys, "s--" if name.startswith("full") else "o-", label=name.replace("_", " "))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("prompt tokens / s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{report.get('config', '')} ({report.get('machine', '')}, {report.get('date', '')})", fontsize=9)
    ax.legend(fontsize=7)

    proj = report.get("one_million") or {}
    proj = {"exact": proj} if "fit" in proj else proj
    S = np.geomspace(4096, ONE_M, 64)
    for sch, p in proj.items():
        a, b = p["fit"]["a_s_per_token"], p["fit"]["b_s_per_token2"]
        key = "full_extrapolated" + ("" if sch == "exact" else f"-{sch}")
        line = bx.plot(S, a * S + b * S * S, "-", label=f"{sch}: a·S + b·S² → {p['s_one_gpu_equivalent']:,.0f} s")
        pts = [(r["tokens"], r[key]["s"]) for r in report["rows"] if key in r]
        if pts:
            bx.plot(*zip(*pts), "o", color=line[0].get_color())
    rival = report.get("rival") or {}
    if rival.get("one_million_s"):
        bx.plot([ONE_M], [rival["one_million_s"]], "*", ms=12, color="k",
                label=f"{rival.get('engine', 'rival')}: {rival['one_million_s']} s")
        bx.plot([ONE_M], [rival["one_million_s"] * B300X8_IN_H200S], "*", ms=12, color="grey",
                label=f"rival x {B300X8_IN_H200S} (its compute in H200s): {rival['one_million_s'] * B300X8_IN_H200S:.0f} s")
    bx.set_xscale("log", base=2)
    bx.set_yscale("log")
    bx.set_xlabel("prompt tokens")
    bx.set_ylabel("seconds (full model, one H200-equivalent)")
    bx.set_title("1M-token projection (extrapolated)", fontsize=9)
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def merge(reports: list[dict]) -> dict:
    """One report from several runs of the same model: rows by prompt length (later runs win), the projection
    refitted through every full-model point (`prefill.one_million`). Runs of different configs or chunks are
    refused: their rows do not belong in one fit."""
    from dsjax.bench.prefill import one_million
    from dsjax.errors import ConfigError

    for key in ("config", "schedules"):
        seen = list(dict.fromkeys(str(rep.get(key)) for rep in reports))
        if len(seen) > 1:
            raise ConfigError(f"these prefill reports differ in {key} ({', '.join(seen)}): one fit needs one")
    if len({r.get("chunk") for rep in reports for r in rep["rows"]}) > 1:
        raise ConfigError("these prefill reports were timed with different chunks: one fit needs one")
    base = dict(reports[-1])
    for key in ("machine", "jax", "date"):                  # where the rows were timed
        base[key] = " / ".join(dict.fromkeys(str(rep.get(key)) for rep in reports))
    base["merged_from"] = [rep.get("command") for rep in reports]
    rows = {r["tokens"]: r for rep in reports for r in rep["rows"]}
    base["rows"] = [rows[n] for n in sorted(rows)]
    keys = sorted({k for r in base["rows"] for k in r if k.startswith("full_extrapolated")})
    full_name = base.get("config", "").split("-slice")[0]
    proj = {("exact" if k == "full_extrapolated" else k.split("-", 1)[1]): one_million(base["rows"], k, full_name)
            for k in keys if sum(k in r for r in base["rows"]) >= 2}
    base["one_million"] = proj or None
    return base


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reports", nargs="+", help="prefill JSON reports (same model)")
    p.add_argument("--out", required=True, help="PNG to write")
    p.add_argument("--json", default=None, help="also write the merged report (rows and the refitted 1M projection)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    reports = []
    for path in args.reports:
        with open(path) as f:
            reports.append(json.load(f))
    report = merge(reports) if len(reports) > 1 else reports[0]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    done = plot_prefill(report, args.out)
    print(done or "matplotlib is not installed: no plot", file=sys.stderr)
    return 0 if done else 1


if __name__ == "__main__":
    raise SystemExit(main())
