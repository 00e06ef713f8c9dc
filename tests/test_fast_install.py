"""tools/fast_install.py hands uv the sources pip would use: pip's settings as `pip config list` reports them
(here through PIP_* variables, the highest scope), local sources that do not exist left out, as pip ignores them."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import fast_install  # noqa: E402


def test_pip_settings_become_uv_flags(tmp_path, monkeypatch):
    wheels, constraints = tmp_path / "wheels", tmp_path / "c.txt"
    wheels.mkdir()
    constraints.write_text("torch<=2.14.1\n")
    monkeypatch.setenv("PIP_FIND_LINKS", f"{wheels} {tmp_path / 'gone'}")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", f"https://example.invalid/simple file://{tmp_path / 'no-index'}")
    monkeypatch.setenv("PIP_CONSTRAINT", str(constraints))
    flags = fast_install.pip_sources(fast_install.pip_config(sys.executable))
    pairs = list(zip(flags[::2], flags[1::2]))
    assert ("--find-links", str(wheels)) in pairs and ("--constraint", str(constraints)) in pairs
    assert ("--extra-index-url", "https://example.invalid/simple") in pairs
    assert not any("gone" in v or "no-index" in v for _, v in pairs) and "--no-index" not in flags
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    assert "--no-index" in fast_install.pip_sources(fast_install.pip_config(sys.executable))


def test_usage_error_without_arguments():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "fast_install.py")], capture_output=True,
                          text=True)
    assert done.returncode == 2 and "Usage" in done.stderr
