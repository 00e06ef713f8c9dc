"""Runs in its own process with 8 CPU devices (the test process has one): every mesh check, JSON out.

Usage: python tests/mesh_worker.py SEED  -> prints one JSON object on the last line.
The config is tiny-v4 with dims divisible by 8; numerics are the "transformers" preset (fp32 activations, no
fake quantisation) computed batched, so a mesh can only reorder fp32 sums — see test_mesh.py for tolerances.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsjax import config, sharding
from dsjax.api import Model
from dsjax.bench.collectives import COLLECTIVE  # one pattern for the tests and `dsjax bench tp`
from dsjax.generate import _chunk_ids, _prefill_chunk
from dsjax.model import forward_chunk
from dsjax.params import init_params
from dsjax.state import init_state
from dsjax.weights import describe, is_info

MESHES = {"1x8": (1, 8, "tp"), "2x4": (2, 4, "tp"), "ep8": (2, 4, "all")}
MAX_SEQ, NEW_TOKENS, DECODE_STEPS = 128, 32, 4
PREFILL_CHUNK = 32  # generate's chunk for these prompts: the next power of two over the longest (28)


def test_config(ep: str = "tp"):
    """tiny-v4 cut to one layer of each kind, every sharded dim divisible by 8. Every layer hash-routed and the
    indexer keeping every visible entry (index_topk ≥ MAX_SEQ / 4): no top-k choice remains that an fp32
    reassociation could flip, so the outputs are continuous in the weights and the tolerance argument holds.
    A 16k vocabulary: the head still splits 8 ways; the full 129k only added run time (124 s -> 89 s alone)."""
    cfg = config._tiny_v4(name="tiny-v4-tp8", vocab_size=16384, n_layers=3, compress_ratios=(0, 4, 16, 0), n_hash_layers=3,
                          n_heads=8, o_groups=8, o_lora_rank=128, moe_inter_dim=1024, index_n_heads=16,
                          index_topk=MAX_SEQ // 4)
    return cfg.with_numerics("transformers").replace(batch_invariant=False, sharding=sharding.rules_for(ep))


def place(cfg, mesh, host_params):
    if mesh is None:
        return jax.tree.map(jnp.asarray, host_params)
    return jax.tree.map(sharding.put, host_params, sharding.param_shardings(cfg, mesh))


def on(mesh):
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()


def run_model(cfg, mesh, host_params, prompts):
    """On one mesh (None: one device): the prompts' prefill logits, logits of the decode steps after it, the
    compiled decode step's HLO text, and greedy generations through the on-device loop with top-2 logprobs. The
    prefill is the loop's own compiled chunk (the same function, shapes and shardings: compiled once for both)."""
    params = place(cfg, mesh, host_params)
    lengths = np.array([len(p) for p in prompts], np.int32)
    with on(mesh):  # inputs made on the mesh, as generate makes them
        chunk = jnp.asarray(_chunk_ids(prompts, len(prompts), 0, PREFILL_CHUNK))
        state = init_state(cfg, len(prompts), MAX_SEQ)
        prefill, _, state = _prefill_chunk(params, chunk, chunk, state, jnp.asarray(lengths), jnp.asarray(lengths),
                                           None, cfg=cfg, mtp=False)
        at_last = jnp.take_along_axis(prefill, jnp.asarray(lengths - 1)[:, None, None], axis=1)  # keeps dp
        last = jnp.argmax(at_last[:, 0], axis=-1).astype(jnp.int32)[:, None]
        step = jax.jit(lambda p, t, s: forward_chunk(p, cfg, t, s))
        decode_step = step.lower(params, last, state).compile()
        decode = []
        for _ in range(DECODE_STEPS):
            logits, state = decode_step(params, last, state)
            decode.append(np.asarray(logits[:, 0]))
            last = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)[:, None]
    gens = Model(cfg, params, max_seq_len=MAX_SEQ, max_batch=4, mesh=mesh).generate(prompts, NEW_TOKENS, logprobs=2)
    valid = np.arange(PREFILL_CHUNK)[None, :] < lengths[:, None]  # padded positions are no row's logits
    return {"prefill": np.asarray(prefill)[valid], "decode": np.stack(decode), "hlo": decode_step.as_text(),
            "greedy": [g.tokens for g in gens],
            "margins": [[t["top"][0][1] - t["top"][1][1] for t in g.logprobs] for g in gens]}


def collectives(cfg, hlo: str):
    """Per decoder layer: counts of each collective in a compiled step, and every all-gather / all-to-all whose
    result has the global shape of a sharded weight (a weight gathered whole)."""
    infos = jax.tree.leaves(describe(cfg), is_leaf=is_info)
    sharded = {tuple(i.shape) for i in infos if any(cfg.sharding.mesh_axes(a) for a in i.axes)}
    per_layer: dict = {}
    gathered_weights = []
    for line in hlo.splitlines():
        m = COLLECTIVE.search(line)
        if not m:
            continue
        op = re.search(r'op_name="([^"]*)"', line)
        layer = re.search(r"/layer(\d+)/", op.group(1)) if op else None
        key = f"layer{layer.group(1)}" if layer else "outside"
        per_layer.setdefault(key, {}).setdefault(m.group(2), 0)
        per_layer[key][m.group(2)] += 1
        if m.group(2) in ("all-gather", "all-to-all"):
            for dims in re.findall(r"\[([\d,]*)\]", m.group(1)):
                shape = tuple(int(d) for d in dims.split(",") if d)
                if shape in sharded:
                    gathered_weights.append((key, shape))
    return per_layer, gathered_weights


def main(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    cfg = test_config()
    host = init_params(cfg, seed, put=np.asarray)  # the sharding rules do not change the weights
    prompts = [list(map(int, rng.integers(0, cfg.vocab_size, n))) for n in (5, 28, 9, 19)]
    t0 = time.perf_counter()
    ref = run_model(cfg, None, host, prompts)
    out: dict = {"seed": seed, "single": {"greedy": ref["greedy"], "margins": ref["margins"],
                                          "seconds": time.perf_counter() - t0},
                 "layer_kinds": [cfg.layer_kind(i) for i in range(cfg.n_layers)], "meshes": {}}
    for name, (dp, tp, ep) in MESHES.items():
        t0 = time.perf_counter()
        cfg_ep = test_config(ep)
        got = run_model(cfg_ep, sharding.make_mesh(tp, dp), host, prompts)
        per_layer, gathered = collectives(cfg_ep, got["hlo"])
        out["meshes"][name] = {
            "prefill_max_abs": float(np.abs(got["prefill"] - ref["prefill"]).max()),
            "prefill_scale": float(np.abs(ref["prefill"]).max()),
            "decode_max_abs": float(np.abs(got["decode"] - ref["decode"]).max()),
            "decode_scale": float(np.abs(ref["decode"]).max()),
            "greedy": got["greedy"],
            "collectives": per_layer,
            "gathered_weights": gathered,
            "seconds": time.perf_counter() - t0,
        }
    return out


if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)  # before any backend starts (importers set their own count)
    print(json.dumps(main(int(sys.argv[1]))))
