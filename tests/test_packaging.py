"""Every package folder is installed: pyproject lists packages by hand (the remapped pallas_kernels/ and serving/
are invisible to setuptools' discovery), so a new sub-package must be added there — this test says which."""

import os
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_package_folder_is_listed_in_pyproject():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        tool = tomllib.load(f)["tool"]["setuptools"]
    listed = set(tool["packages"])
    folders = {folder: name for name, folder in tool["package-dir"].items()}
    found = set()
    for folder, name in folders.items():
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            if "__init__.py" in files and "__pycache__" not in dirpath:
                rel = os.path.relpath(dirpath, os.path.join(ROOT, folder))
                found.add(name if rel == "." else name + "." + rel.replace(os.sep, "."))
    assert found - listed == set(), f"add to [tool.setuptools] packages in pyproject.toml: {sorted(found - listed)}"
    # A data-only folder (no __init__.py, files in package-data) is listed too, or setuptools warns that it is
    # importable as a namespace package yet absent from `packages`.
    data_only = {name for name in tool["package-data"] if name not in found}
    assert listed - found == data_only, f"listed but missing: {sorted(listed - found - data_only)}"
    for name in data_only:
        assert os.path.isdir(_folder_of(name, tool["package-dir"])), f"package-data names {name}: no such folder"


def _folder_of(package, package_dir):
    """The folder a dotted package name installs from: its longest prefix in package-dir, then the rest as folders."""
    prefix = max((p for p in package_dir if package == p or package.startswith(p + ".")), key=len)
    return os.path.join(ROOT, package_dir[prefix], *package[len(prefix):].split(".")[1:])


def test_kernels_and_serving_import_under_dsjax():
    import dsjax.kernels.sparse_mqa  # noqa: F401
    import dsjax.serving  # noqa: F401


def test_bundled_checkpoint_ships_and_every_entry_point_resolves_it():
    """dsjax-small is package data (≤ 16 MB: every GPU run carries the tree) and the default of generate and serve."""
    from dsjax.assets import BUNDLED, resolve
    from dsjax.cli import DEFAULT_MODEL
    from dsjax.serving.config import ServeConfig
    from dsjax.serving.server import _model_config

    path = BUNDLED["dsjax-small"]
    assert resolve("dsjax-small") == path and resolve("tiny-v4") == "tiny-v4"
    assert os.path.getsize(os.path.join(path, "model.safetensors")) <= 16 << 20
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        assert "dsjax-small/*" in tomllib.load(f)["tool"]["setuptools"]["package-data"]["dsjax.assets"]
    assert DEFAULT_MODEL == ServeConfig().model == "dsjax-small"
    assert _model_config(ServeConfig()).head_vocab_size == 6007
