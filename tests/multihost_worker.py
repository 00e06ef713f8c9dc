"""One of two processes of a multi-host run on 127.0.0.1: 4 CPU devices each, one 8-device (1x8) forward.

Usage: python tests/multihost_worker.py PROCESS_ID PORT SEED OUT_NPZ
Both processes initialise `jax.distributed` against process 0's coordinator, build the same global mesh and
weights, run the same jitted forward, and gather the vocab-sharded logits; process 0 writes them.
"""

from __future__ import annotations

import sys

import jax


def main(process_id: int, port: int, seed: int, out: str) -> None:
    jax.config.update("jax_num_cpu_devices", 4)
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                               initialization_timeout=120)
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils

    from dsjax import sharding
    from dsjax.model import forward
    from dsjax.params import init_params
    from mesh_worker import test_config, place

    assert jax.device_count() == 8 and jax.local_device_count() == 4, (jax.device_count(), jax.local_device_count())
    cfg = test_config()
    mesh = sharding.make_mesh(tp=8)
    params = place(cfg, mesh, init_params(cfg, seed, put=np.asarray))
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (2, 24)).astype(np.int32)
    with jax.set_mesh(mesh):
        logits = jax.jit(lambda p, t: forward(p, cfg, t))(params, jnp.asarray(tokens))
        logits = multihost_utils.process_allgather(logits, tiled=True)
    if process_id == 0:
        np.savez(out, tokens=tokens, logits=np.asarray(logits), devices=jax.device_count(),
                 processes=jax.process_count())
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
