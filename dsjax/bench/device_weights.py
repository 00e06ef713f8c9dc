"""Random weights drawn on the devices, straight into their shardings: for benchmarks of models too large to
draw on the host (`params.init_params` is exact and seeded per tensor, but numpy-slow at V4-Flash sizes).

Values follow each tensor's init distribution; quantised tensors get random codes (FP8 e4m3 from a scaled
normal, packed FP4 from uniform bytes — every e2m1 code is valid) and one ue8m0 scale chosen so the dequantised
weight has roughly the init's standard deviation. Good for timing and for comparing two runs of the same
weights, not a substitute for the seeded host init in exactness tests.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from dsjax.config import ModelConfig
from dsjax.weights import ArrayInfo, Linear, describe, is_info

_FP4_STD = 2.8  # std of e2m1 values under uniform codes


def _scale_byte(target_std: float, code_std: float) -> int:
    return int(np.clip(127 + round(math.log2(max(target_std, 1e-30) / code_std)), 1, 254))


def _dense(key, info: ArrayInfo, cfg: ModelConfig):
    kind = info.init[0]
    if kind == "tid2eid":
        r = jax.random.uniform(key, (info.shape[0], cfg.n_routed_experts))
        return jnp.argsort(r, axis=1)[:, :info.shape[1]].astype(jnp.int32)
    if kind == "zeros":
        return jnp.zeros(info.shape, info.dtype)
    if kind == "uniform":
        return jax.random.uniform(key, info.shape, jnp.float32, info.init[1], info.init[2]).astype(info.dtype)
    return (jax.random.normal(key, info.shape, jnp.float32) * info.init[1]).astype(info.dtype)


def _linear(key, lin: Linear, cfg: ModelConfig) -> Linear:
    w: ArrayInfo = lin.weight
    if lin.fmt == "fp8":
        codes = (jax.random.normal(key, w.shape, jnp.float32) * 16.0).astype(jnp.float8_e4m3fn)
        return Linear(codes, jnp.full(lin.scale.shape, _scale_byte(w.init[1], 16.0), jnp.uint8), "fp8", lin.block)
    if lin.fmt == "fp4":
        codes = jax.random.bits(key, w.shape, jnp.uint8)
        return Linear(codes, jnp.full(lin.scale.shape, _scale_byte(w.init[1], _FP4_STD), jnp.uint8), "fp4", lin.block)
    return Linear(_dense(key, w, cfg), None, lin.fmt, lin.block)


def device_params(cfg: ModelConfig, shardings, seed: int = 0):
    """The weight tree of `cfg`, each array created sharded on its devices by one jitted program per distinct
    (tensor description, sharding): the layers' identical tensors share one compiled program."""
    tree = describe(cfg)
    nodes, treedef = jax.tree.flatten(tree, is_leaf=lambda x: is_info(x) or isinstance(x, Linear))
    shard_nodes = treedef.flatten_up_to(shardings)
    keys = jax.random.split(jax.random.key(seed), len(nodes))
    programs = {}
    out = []
    for key, node, sh in zip(keys, nodes, shard_nodes):
        make = _linear if isinstance(node, Linear) else _dense
        sig = (repr(node), repr(sh))
        if sig not in programs:
            programs[sig] = jax.jit(lambda k, node=node, make=make: make(k, node, cfg), out_shardings=sh)
        out.append(programs[sig](key))
    return treedef.unflatten(out)
