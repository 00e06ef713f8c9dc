"""Write notebooks/*.ipynb from their sources in notebooks/src/*.py, outputs stripped.

The sources are plain Python in the "percent" format (what Jupytext, VS Code and Spyder read): a line
`# %%` opens a code cell, `# %% [markdown]` a markdown cell whose lines start with `# `. They diff and review
like code; the .ipynb beside them is what Jupyter opens and what CI executes (tests/test_notebooks.py), and a
test checks that the two agree.

    python notebooks/build.py           # rewrite every notebook from its source
    python notebooks/build.py --check   # exit 1, naming them, if committed notebooks differ from their sources
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

import nbformat

HERE = os.path.dirname(os.path.abspath(__file__))
KERNEL = {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
          "language_info": {"name": "python"}}


def cells(source: str) -> list:
    """Percent-format source -> notebook cells (markdown lines lose their leading '# ')."""
    out, kind, lines = [], None, []

    def flush():
        text = "\n".join(lines).strip("\n")
        if kind == "markdown":
            text = "\n".join(line[2:] if line.startswith("# ") else line.lstrip("#") for line in text.split("\n"))
            out.append(nbformat.v4.new_markdown_cell(text))
        elif kind == "code" and text:
            out.append(nbformat.v4.new_code_cell(text))

    for line in source.split("\n"):
        if line.startswith("# %%"):
            flush()
            kind, lines = ("markdown" if "[markdown]" in line else "code"), []
        elif kind is not None:
            lines.append(line)
    flush()
    return out


def build(src: str) -> str:
    """The .ipynb text for one source file (stable cell ids, so rebuilding an unchanged source is a no-op)."""
    with open(src) as f:
        nb = nbformat.v4.new_notebook(cells=cells(f.read()), metadata=KERNEL)
    stem = os.path.splitext(os.path.basename(src))[0]
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"{stem[:2]}-{i:02d}"
    nbformat.validate(nb)
    return nbformat.writes(nb) + "\n"


def sources() -> list[str]:
    return sorted(glob.glob(os.path.join(HERE, "src", "*.py")))


def target(src: str) -> str:
    return os.path.join(HERE, os.path.splitext(os.path.basename(src))[0] + ".ipynb")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="compare instead of writing")
    args = p.parse_args(argv)
    stale = []
    for src in sources():
        text, path = build(src), target(src)
        current = open(path).read() if os.path.exists(path) else None
        if current == text:
            continue
        if args.check:
            stale.append(os.path.relpath(path, HERE))
        else:
            with open(path, "w") as f:
                f.write(text)
            print(f"wrote {os.path.relpath(path)}")
    if stale:
        print(f"out of date (run python notebooks/build.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
