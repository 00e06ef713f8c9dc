"""The research notebooks run top to bottom on CPU, as committed: no cell raises, every notebook renders at least
one plot, and each committed .ipynb is what notebooks/build.py makes of its source (outputs stripped).

Each notebook runs in its own Jupyter kernel (nbclient), one test per notebook so xdist spreads them over the
workers. The kernels get the persistent compilation cache switched off, as the test process itself has it
(conftest.py): CI times are cold-compile times.
"""

import base64
import importlib.util
import os
import time

import nbclient
import nbformat
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(ROOT, "notebooks")
NAMES = sorted(f for f in os.listdir(NOTEBOOKS) if f.endswith(".ipynb"))
CELL_TIMEOUT_S = 300


def test_committed_notebooks_are_built_from_their_sources_without_outputs():
    spec = importlib.util.spec_from_file_location("notebooks_build", os.path.join(NOTEBOOKS, "build.py"))
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    assert [os.path.basename(build.target(s)) for s in build.sources()] == NAMES
    for src in build.sources():
        with open(build.target(src)) as f:
            assert f.read() == build.build(src), f"{build.target(src)} is stale: run python notebooks/build.py"
    for name in NAMES:
        nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
        assert all(not c.get("outputs") and not c.get("execution_count") for c in nb.cells if c.cell_type == "code")


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_and_plots(name, monkeypatch):
    monkeypatch.setenv("JAX_ENABLE_COMPILATION_CACHE", "false")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend turns figures into PNG outputs
    nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": NOTEBOOKS}})
    t0 = time.perf_counter()
    client.execute()  # raises CellExecutionError, with the cell and its traceback, if any cell fails
    print(f"{name}: {time.perf_counter() - t0:.1f} s")
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o["data"]["image/png"] for o in outputs if "image/png" in o.get("data", {})]
    assert images, f"{name} rendered no plot"
    assert all(base64.b64decode(png)[:8] == b"\x89PNG\r\n\x1a\n" for png in images)
    if os.environ.get("DSJAX_NOTEBOOK_OUT"):  # keep the executed notebook (to look at the plots)
        os.makedirs(os.environ["DSJAX_NOTEBOOK_OUT"], exist_ok=True)
        nbformat.write(nb, os.path.join(os.environ["DSJAX_NOTEBOOK_OUT"], name))
