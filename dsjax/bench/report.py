"""The JSON report every benchmark script ends with: its figures plus machine, versions, date and command."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys

import jax


def run_info(name: str, argv=None) -> dict:
    """Where and how a benchmark ran: name, machine, versions, date, command (`argv` None: this process's own
    command line, e.g. `dsjax bench repro ...`)."""
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    if prog.endswith(".py"):  # run as `python -m dsjax.bench.<module>`
        prog = "python -m dsjax.bench." + prog[:-3]
    elif prog == "-c":      # python -c ... (e.g. a test worker): no script name to show
        prog = "python -c"
    command = (f"python -m dsjax.bench.{name} " + " ".join(argv) if argv is not None
               else " ".join([prog, shlex.join(sys.argv[1:])]))
    return {"benchmark": name, "machine": f"{jax.devices()[0].device_kind} x{len(jax.devices())}",
            "jax": jax.__version__, "python": platform.python_version(), "date": datetime.date.today().isoformat(),
            "command": command}


def write_report(name: str, argv, out: str | None, **fields) -> dict:
    """Print the report (and write it to `out`); returns it."""
    report = {**run_info(name, argv), **fields}
    text = json.dumps(report, indent=1)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text)
    return report


def script_main(module_name: str, argv=None) -> int:
    """`python -m dsjax.bench.<module>`: the same flags as `dsjax bench <module>` (its add_args / run)."""
    import argparse
    import importlib

    mod = importlib.import_module(module_name)
    p = argparse.ArgumentParser(description=mod.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mod.add_args(p)
    return mod.run(p.parse_args(argv))


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None where matplotlib is not installed (reports then
    carry their tables and JSON only)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
