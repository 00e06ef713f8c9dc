"""Multi-host: two processes on 127.0.0.1 with 4 CPU devices each run one 8-device forward through
`jax.distributed`; its logits equal this process's single-device forward (fp32: tolerance as in test_mesh.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_single_process(tmp_path, test_seed):
    sys.path.insert(0, HERE)
    from mesh_worker import test_config
    from dsjax.model import forward
    from dsjax.params import init_params

    out, port = str(tmp_path / "logits.npz"), _free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "multihost_worker.py"), str(i), str(port),
                               str(test_seed), out], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    try:
        results = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-4000:]
    got = np.load(out)
    assert int(got["devices"]) == 8 and int(got["processes"]) == 2
    cfg = test_config()
    params = jax.tree.map(jnp.asarray, init_params(cfg, test_seed, put=np.asarray))
    want = np.asarray(jax.jit(lambda p, t: forward(p, cfg, t))(params, jnp.asarray(got["tokens"], jnp.int32)))
    diff = np.abs(np.asarray(got["logits"], np.float32) - want).max()
    scale = np.abs(want).max()
    print(f"seed {test_seed}: 2 processes x 4 devices vs 1 device: max |diff| {diff:.2e} (scale {scale:.1f})")
    assert diff <= 2e-5 * scale
