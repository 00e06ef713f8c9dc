"""Random weights from the one description: each tensor drawn from its own generator, then stored in its format.

Each tensor's generator is `numpy.random.default_rng([seed, crc32(official name)])` (the goldens' scheme), so
a weight does not change when unrelated tensors are added, and a test can name the seed that reproduces it.
Quantised tensors are drawn in float32 and rounded to their checkpoint format (FP8 e4m3 + ue8m0 blocks,
packed FP4 + per-32 ue8m0) exactly as a released checkpoint stores them.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np

from dsjax import quant
from dsjax.checkpoint import official_name
from dsjax.config import ModelConfig
from dsjax.weights import ArrayInfo, Linear, describe, is_info


def _draw(rng: np.random.Generator, info: ArrayInfo, shape) -> np.ndarray:
    kind = info.init[0]
    if kind == "normal":
        return rng.normal(0.0, info.init[1], size=shape).astype(np.float32)
    if kind == "uniform":
        return rng.uniform(info.init[1], info.init[2], size=shape).astype(np.float32)
    if kind == "zeros":
        return np.zeros(shape, np.float32)
    raise ValueError(f"unknown init {info.init}")


def _tid2eid(rng: np.random.Generator, vocab: int, k: int, n_experts: int) -> np.ndarray:
    """Distinct random experts per token id, as the goldens draw them."""
    return np.argsort(rng.random((vocab, n_experts)), axis=1)[:, :k].astype(np.int32)


def _linear_init(seed: int, name: str, lin: Linear) -> Linear:
    info: ArrayInfo = lin.weight
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    w = _draw(rng, info, info.logical_shape)
    if lin.fmt == "fp8":
        q, s = quant.quantize_fp8_blocks(w.reshape((-1,) + w.shape[-2:]), lin.block)
        return Linear(q.reshape(info.shape), s.reshape(lin.scale.shape), "fp8", lin.block)
    if lin.fmt == "fp4":
        q, s = quant.quantize_fp4_packed(w.reshape((-1,) + w.shape[-2:]), lin.block)
        return Linear(q.reshape(info.shape), s.reshape(lin.scale.shape), "fp4", lin.block)
    return Linear(w.astype(jnp.bfloat16), None, "bf16", 0)


def init_params(cfg: ModelConfig, seed: int = 0, *, put=jnp.asarray):
    """Random weights for `cfg` in checkpoint formats; `put` moves each host array to devices."""
    tree = describe(cfg)

    def is_node(x):
        return is_info(x) or isinstance(x, Linear)

    def init(path, node):
        name = official_name(path + (jax.tree_util.GetAttrKey("weight"),) if isinstance(node, Linear) else path)
        name = name.replace(".{e}", "")
        if isinstance(node, Linear):
            lin = _linear_init(seed, name, node)
            return Linear(put(lin.weight), None if lin.scale is None else put(lin.scale), lin.fmt, lin.block)
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        if node.init[0] == "tid2eid":
            return put(_tid2eid(rng, node.shape[0], node.shape[1], cfg.n_routed_experts))
        if node.init[0] == "vocab_ids":  # the first ids in order, then the reserved row (id vocab_size: no column)
            return put(np.append(np.arange(node.shape[0] - 1), cfg.vocab_size).astype(np.int32))
        a = _draw(rng, node, node.shape)
        if name.endswith("attn.wo_a.weight") and cfg.weight_dtype == "fp8":
            # released checkpoints store wo_a in FP8 (dequantised on load): draw what they could hold
            a = quant.dequantize_fp8_blocks_np(*quant.quantize_fp8_blocks(a, cfg.weight_block_size), cfg.weight_block_size)
        return put(a.astype(node.dtype))

    return jax.tree_util.tree_map_with_path(init, tree, is_leaf=is_node)
