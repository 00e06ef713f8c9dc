"""The JSON report every benchmark script ends with: its figures plus machine, versions, date and command."""

from __future__ import annotations

import datetime
import json
import platform

import jax


def run_info(name: str, argv) -> dict:
    """Where and how a benchmark ran: name, machine, versions, date, command."""
    return {"benchmark": name, "machine": f"{jax.devices()[0].device_kind} x{len(jax.devices())}",
            "jax": jax.__version__, "python": platform.python_version(), "date": datetime.date.today().isoformat(),
            "command": f"python -m dsjax.bench.{name} " + " ".join(argv)}


def write_report(name: str, argv, out: str | None, **fields) -> dict:
    """Print the report (and write it to `out`); returns it."""
    report = {**run_info(name, argv), **fields}
    text = json.dumps(report, indent=1)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text)
    return report
