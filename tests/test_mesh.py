"""Sharded runs equal the single-device run: meshes 1x8 and 2x4 (dp x tp) and 8-way expert parallelism.

The checks run in a subprocess with 8 CPU devices (tests/mesh_worker.py; this process already has one).
Tolerances: the worker computes in fp32 with no top-k choice left that rounding could flip (see its config), so
a mesh only reorders fp32 sums — row-parallel matmul partials, indexer head sums and expert outputs added by
an all-reduce instead of in one loop. Each reordering moves a result by a few fp32 ulps of the magnitudes summed
(2^-24 ≈ 6e-8 relative); through 3 blocks and the head that stays near 1e-6 of the logit scale (measured:
~1e-5 on logits of magnitude ~10). We allow 2e-5 of the scale: 20x the measured spread, still ~100x below a
single bf16 ulp, so a dropped shard, a double-counted psum or a mis-sliced head fails at once. Greedy tokens must
be identical up to the first step where the single-device top-2 log-probability margin is under 1e-3 (a tie
within the tolerance could legitimately go either way; after it the rows may diverge).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
pytestmark = pytest.mark.xdist_group("mesh")  # one worker runs the (session-scoped) 8-device subprocess once
REL_TOL = 2e-5
TIE_MARGIN = 1e-3


@pytest.fixture(scope="session")
def mesh_results(test_seed):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "mesh_worker.py"), str(test_seed)],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"mesh worker seed {test_seed}: " + ", ".join(f"{k} {v['seconds']:.0f}s" for k, v in out["meshes"].items()))
    return out


MESHES = ["1x8", "2x4", "ep8"]


@pytest.mark.parametrize("mesh", MESHES)
def test_prefill_and_decode_logits_match_one_device(mesh_results, mesh):
    r = mesh_results["meshes"][mesh]
    print(mesh, {k: r[k] for k in ("prefill_max_abs", "decode_max_abs", "prefill_scale")})
    assert r["prefill_max_abs"] <= REL_TOL * r["prefill_scale"]
    assert r["decode_max_abs"] <= REL_TOL * r["decode_scale"]


@pytest.mark.parametrize("mesh", MESHES)
def test_greedy_loop_matches_one_device(mesh_results, mesh):
    single, margins = mesh_results["single"]["greedy"], mesh_results["single"]["margins"]
    got = mesh_results["meshes"][mesh]["greedy"]
    for row, (want, have, margin) in enumerate(zip(single, got, margins)):
        assert len(have) == len(want) == 32
        n = next((i for i, m in enumerate(margin) if m < TIE_MARGIN), len(want))
        if n < len(want):
            print(f"{mesh} row {row}: near-tie at token {n} (margin {margin[n]:.2e}); compared before it")
        assert have[:n] == want[:n], f"{mesh} row {row} diverged before any near-tie"


@pytest.mark.parametrize("mesh", MESHES)
def test_decode_step_collectives(mesh_results, mesh):
    """No weight is ever all-gathered whole; per decoder layer the decode step all-reduces after the attention
    output, after the FFN (shared expert + routed experts, fused by XLA) and, in CSA layers, the indexer's
    head-summed scores; expert parallelism over dp x tp adds the token all-gathers and one reduce-scatter."""
    r = mesh_results["meshes"][mesh]
    assert r["gathered_weights"] == []
    kinds = mesh_results["layer_kinds"]
    for i, kind in enumerate(kinds):
        counts = r["collectives"].get(f"layer{i}", {})
        print(mesh, i, kind, counts)
        assert counts.get("all-reduce", 0) == (3 if kind == "csa" else 2)
        assert counts.get("all-to-all", 0) == 0 and counts.get("collective-permute", 0) == 0
        if mesh == "ep8":
            assert counts.get("reduce-scatter", 0) == 1
        else:
            assert counts.get("reduce-scatter", 0) == 0
        if mesh == "1x8":  # pure tensor parallelism: activations stay replicated, nothing is gathered
            assert counts.get("all-gather", 0) == 0


V41_WORKER = """
import json, sys
import jax, numpy as np, jax.numpy as jnp
jax.config.update("jax_num_cpu_devices", 2)
import dsjax
from dsjax import sharding
from dsjax.bench.collectives import collective_ops
from dsjax.model import forward
from dsjax.params import init_params
seed = int(sys.argv[1])
cfg = dsjax.preset("tiny-v41").with_numerics("transformers")
host = init_params(cfg, seed, put=np.asarray)
ids = jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, (1, 20)), jnp.int32)
fwd = lambda p, t: forward(p, cfg, t)
one = np.asarray(jax.jit(fwd)(jax.tree.map(jnp.asarray, host), ids))
mesh = sharding.make_mesh(2, 1)
params = jax.tree.map(sharding.put, host, sharding.param_shardings(cfg, mesh))
with jax.set_mesh(mesh):
    step = jax.jit(fwd).lower(params, ids).compile()
    two = np.asarray(step(params, ids))
whole_tables = {(n, cfg.engram_head_dim) for n in cfg.engram_num_embeddings}
local_tables = {(n // 2, cfg.engram_head_dim) for n in cfg.engram_num_embeddings}
shard_shapes = {tuple(a.addressable_shards[0].data.shape) for a in jax.tree.leaves(params)
                if tuple(a.shape) in whole_tables and a.dtype == jnp.float8_e4m3fn}
gathered = [arrays for kind, arrays in collective_ops(step.as_text()) if kind == "all-gather"
            and any(tuple(shape) in whole_tables for _, shape in arrays)]
print(json.dumps({"max_abs": float(np.abs(one - two).max()), "scale": float(np.abs(one).max()),
                  "table_shards": sorted(map(list, shard_shapes)), "local_tables": sorted(map(list, local_tables)),
                  "tables_gathered": len(gathered)}))
"""


@pytest.mark.xdist_group("mesh_v41")  # its own subprocess: free to run beside the 8-device worker
def test_v41_tensor_parallel_logits_match_one_device(test_seed):
    """V4.1 (CSA2, Engram, staggered mHC, vision-free text path) at TP2 on two CPU devices equals one device, in
    fp32 ("transformers" numerics), to the same reassociation tolerance as V4 above; the Engram tables are split by
    rows over the devices and never gathered."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-c", V41_WORKER, str(test_seed)], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"V4.1 TP2 vs one device, seed {test_seed}: {r}")
    assert r["max_abs"] <= REL_TOL * r["scale"]
    assert r["table_shards"] == r["local_tables"]   # each device holds half of every Engram table's rows
    assert r["tables_gathered"] == 0                 # and the lookup never gathers a table whole
