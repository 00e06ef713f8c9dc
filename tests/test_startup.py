"""Start-up: process start -> first token of the tiny default on CPU, cold and with a warm compilation cache.

Recorded (printed) rather than tight-bounded: CPU timings vary with the machine's load. The bounds only catch
a regression by an order of magnitude, and the warm run must beat the cold one (the cache works).
"""

import json
import os
import subprocess
import sys
import time


def _first_token_s(cache_dir: str) -> float:
    t0 = time.time()
    out = subprocess.run([sys.executable, "-m", "dsjax.cli", "generate", "--prompt", "Hello", "--max-new-tokens", "4",
                          "--json", "--compilation-cache", cache_dir], capture_output=True, text=True, timeout=600,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    stats = json.loads(out.stdout)["stats"]
    return stats["first_token_unix_s"] - t0


def test_process_start_to_first_token(tmp_path):
    cold = _first_token_s(str(tmp_path / "xla"))
    warm = _first_token_s(str(tmp_path / "xla"))
    print(f"dsjax-small (the default) on CPU, process start -> first token: cold cache {cold:.1f} s, warm cache {warm:.1f} s")
    assert warm < cold
    assert cold < 300
