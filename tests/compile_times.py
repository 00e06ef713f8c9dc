"""Where the suite's time goes: XLA compiles per test, as an opt-in pytest plugin and its summary (docs/testing.md).

The suite is compile-bound on two cores, so the way to trim it is to find the tests that compile the most. Run

    DSJAX_COMPILE_REPORT=/tmp/cr PYTHONPATH=tests python -m pytest -q -n 2 --dist loadgroup -p compile_times
    python tests/compile_times.py /tmp/cr

Each pytest process (xdist worker or main) writes DIR/<worker>.json: per test id, [backend compiles, their seconds,
lowerings + traces, their seconds], from `jax.monitoring`'s duration events. Compiles in subprocesses (the mesh
worker, CLI and server tests) are not seen.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import sys

_BACKEND = "backend_compile_duration"
_LOWERING = ("jaxpr_to_mlir_module_duration", "jaxpr_trace_duration")


class _Recorder:
    def __init__(self):
        self.current = "<outside a test>"
        self.stats: dict[str, list] = collections.defaultdict(lambda: [0, 0.0, 0, 0.0])

    def on_duration(self, event: str, duration: float, **_):
        row = self.stats[self.current]
        if event.endswith(_BACKEND):
            row[0] += 1
            row[1] += duration
        elif event.endswith(_LOWERING):
            row[2] += 1
            row[3] += duration


_recorder = _Recorder()


def pytest_configure(config):
    if not os.environ.get("DSJAX_COMPILE_REPORT"):
        raise SystemExit("compile_times: set DSJAX_COMPILE_REPORT to the directory for its reports")
    import jax

    jax.monitoring.register_event_duration_secs_listener(_recorder.on_duration)


def pytest_runtest_logstart(nodeid, location):
    _recorder.current = nodeid


def pytest_runtest_logfinish(nodeid, location):
    _recorder.current = "<between tests>"


def pytest_sessionfinish(session):
    out = os.environ["DSJAX_COMPILE_REPORT"]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, os.environ.get("PYTEST_XDIST_WORKER", "main") + ".json"), "w") as f:
        json.dump(dict(_recorder.stats), f)


def summarize(directory: str, top: int = 25) -> str:
    stats: dict[str, list] = collections.defaultdict(lambda: [0, 0.0, 0, 0.0])
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        with open(path) as f:
            for test, row in json.load(f).items():   # rows added: every worker has its own "<between tests>"
                stats[test] = [a + b for a, b in zip(stats[test], row)]
    if not stats:
        raise SystemExit(f"compile_times: no reports in {directory}")
    totals = [sum(v[i] for v in stats.values()) for i in range(4)]
    by_file: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for test, v in stats.items():
        row = by_file[test.split("::")[0]]
        row[0] += v[0]
        row[1] += v[1] + v[3]
    lines = [f"{totals[0]} backend compiles ({totals[1]:.0f} s), {totals[2]} lowerings and traces ({totals[3]:.0f} s)",
             "", "by file: compiles, compile + lowering seconds"]
    lines += [f"  {n:6d} {s:7.1f}  {f}" for f, (n, s) in sorted(by_file.items(), key=lambda kv: -kv[1][1])[:top]]
    lines += ["", "by test: compiles, compile + lowering seconds"]
    ranked = sorted(stats.items(), key=lambda kv: -(kv[1][1] + kv[1][3]))[:top]
    lines += [f"  {v[0]:6d} {v[1] + v[3]:7.1f}  {t}" for t, v in ranked]
    return "\n".join(lines)


if __name__ == "__main__":
    print(summarize(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("DSJAX_COMPILE_REPORT", "")))
