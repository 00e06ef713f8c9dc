"""Runs transformers' DeepseekV4ForCausalLM (our V4 oracle) in its own venv as a subprocess; exchanges .npz.

The JAX venv never imports torch: `run_oracle` writes the ids, calls tests/oracle/run_transformers.py with
the oracle venv's python (built on demand by tests/oracle/build_venv.sh) and reads its outputs back.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def oracle_python() -> str:
    out = subprocess.run(["bash", os.path.join(HERE, "oracle", "build_venv.sh")], capture_output=True, text=True,
                         timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"building the oracle venv failed:\n{out.stdout}\n{out.stderr}")
    return out.stdout.strip().splitlines()[-1]


def run_oracle(model_dir: str, ids: np.ndarray, workdir: str, *, greedy: int = 0, positions: str = "none",
               timeout: int = 600) -> dict[str, np.ndarray]:
    ids_path = os.path.join(workdir, "ids.npy")
    out_path = os.path.join(workdir, "oracle.npz")
    np.save(ids_path, np.asarray(ids, np.int64))
    cmd = [oracle_python(), os.path.join(HERE, "oracle", "run_transformers.py"), "--model-dir", model_dir,
           "--ids", ids_path, "--out", out_path, "--greedy", str(greedy), "--positions", positions]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    sys.stdout.write(proc.stdout[-4000:])
    if proc.returncode != 0:
        raise RuntimeError(f"oracle failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    with np.load(out_path) as z:
        return {k: z[k] for k in z.files}
