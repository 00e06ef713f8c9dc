"""`pip install ARGS` into a venv through uv, with pip's own sources and constraints; pip itself where uv fails.

Usage: python tools/fast_install.py VENV_PYTHON PIP_ARGS...   (run by `make venv` and tests/oracle/build_venv.sh)

Why: the two venvs are most of CI's set-up time, and uv (a PyPI wheel) installs the same versions 2-4x faster than
pip (a clean clone on the 2-core box, uv's cache empty: `make venv` 15.7 s where pip's install step alone took 31.2
s; `make oracle` 9.4 s against 37.5 s). uv reads no pip configuration, so the index, extra indexes, find-links and
constraint files that pip would use (its config files and PIP_* variables, through `pip config list`) are passed
on, and uv picks the best version across all of them as pip does (`unsafe-best-match`: the local CPU torch wheel,
2.13.0+cpu, over PyPI's 2.13.0 CUDA build). Local sources that do not exist are left out, as pip ignores them. uv
lives in the venv of the python running this script; `DSJAX_NO_UV=1` goes straight to pip.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import urllib.parse

_OPTIONS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
            "constraint": "--constraint"}


def pip_config(python: str) -> dict[str, list[str]]:
    """pip's effective settings by name (files, then PIP_* variables: a later scope overrides an earlier one)."""
    out = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    found: dict[str, list[str]] = {}
    for line in out.splitlines():
        key, _, value = line.partition("=")
        found[key.rpartition(".")[2]] = shlex.split(value.strip().strip("'\""))
    return found


def pip_sources(found: dict[str, list[str]]) -> list[str]:
    """uv flags for the index (or none), extra indexes, find-links and constraints pip would use."""
    flags = []
    for name, flag in _OPTIONS.items():
        for v in found.get(name, ()):
            if not _is_missing_local(v):
                flags += [flag, v]
    if found.get("no-index", ["0"])[0].lower() in ("1", "true", "yes", "on"):
        flags.append("--no-index")                               # an offline machine: local sources only
    return flags


def _is_missing_local(location: str) -> bool:
    parsed = urllib.parse.urlparse(location)
    if parsed.scheme in ("http", "https"):
        return False
    path = urllib.parse.unquote(parsed.path) if parsed.scheme == "file" else location
    return not os.path.exists(path)


def uv_binary() -> str | None:
    """This venv's uv, installed from PyPI on first use; None if that fails."""
    uv = os.path.join(os.path.dirname(sys.executable), "uv")
    if not os.path.exists(uv):
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "uv"], capture_output=True, text=True)
        if done.returncode != 0:
            print(f"fast_install: uv not installed ({done.stderr.strip()[-300:]}); using pip", file=sys.stderr)
            return None
    return uv


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    python, args = argv[0], argv[1:]
    uv = None if os.environ.get("DSJAX_NO_UV") else uv_binary()
    if uv:
        found = pip_config(python)
        cmd = [uv, "pip", "install", "-q", "--python", python, "--index-strategy", "unsafe-best-match",
               *pip_sources(found), *args]
        env = dict(os.environ)
        if found.get("cert") and os.path.exists(found["cert"][0]):
            env.setdefault("SSL_CERT_FILE", found["cert"][0])     # pip's CA bundle (a proxy's, say) for uv too
        if subprocess.run(cmd, env=env).returncode == 0:
            return 0
        print(f"fast_install: uv failed ({shlex.join(cmd)}); retrying with pip", file=sys.stderr)
    return subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", *args]).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
