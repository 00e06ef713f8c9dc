"""Checkpoints: the official DeepSeek layout (and transformers' layout) <-> the weight pytree.

Names come from the weight tree itself (`official_name`), so loading checks every tensor the config implies:
present, of the right shape, of the right dtype — and nothing unexpected. Tensors stream one at a time from
memory-mapped shards; stacked experts are assembled from their per-expert tensors.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dsjax import quant, safetensors_io
from dsjax.config import ModelConfig, load_config
from dsjax.errors import CheckpointError
from dsjax.weights import ArrayInfo, Linear, describe, is_info

_AS_IS = {"ape", "attn_sink", "tid2eid", "bias"}
_HC = re.compile(r"\b(hc_attn|hc_ffn|hc_head)\.(fn|base|scale)$")


def _path_names(path) -> list[str]:
    out = []
    for k in path:
        if isinstance(k, jax.tree_util.GetAttrKey):
            out.append(k.name)
        elif isinstance(k, jax.tree_util.SequenceKey):
            out.append(str(k.idx))
        else:
            out.append(str(getattr(k, "key", k)))
    return out


def official_name(path) -> str:
    """Weight-tree key path -> official tensor name; stacked experts contain the placeholder `{e}`."""
    parts = _path_names(path)
    name = ".".join(parts)
    name = re.sub(r"^mtp\.(\d+)\.block\.", r"mtp.\1.", name)
    name = _HC.sub(lambda m: f"{m.group(1)}_{m.group(2)}", name)
    name = name.replace("ffn.gate_bias", "ffn.gate.bias").replace("ffn.tid2eid", "ffn.gate.tid2eid")
    name = re.sub(r"ffn\.shared_(w\d)\.", r"ffn.shared_experts.\1.", name)
    name = re.sub(r"ffn\.(w\d)\.", r"ffn.experts.{e}.\1.", name)
    last = name.rsplit(".", 1)[-1]
    in_linear = last in ("weight", "scale") and not _HC.search(".".join(parts))
    if not in_linear and last not in _AS_IS and not re.search(r"hc_(attn|ffn|head)_(fn|base|scale)$", name):
        name += ".weight"
    return name


_STORED = {  # stored dtype -> (safetensors tags accepted, numpy dtype on the device side)
    jnp.dtype(jnp.float8_e4m3fn): ("F8_E4M3",),
    jnp.dtype(jnp.uint8): ("F8_E8M0", "I8", "U8"),
    jnp.dtype(jnp.bfloat16): ("BF16",),
    jnp.dtype(jnp.float32): ("F32",),
    jnp.dtype(jnp.int32): ("I64", "I32"),
}


def _convert(name: str, a: np.ndarray, info: ArrayInfo) -> np.ndarray:
    want = jnp.dtype(info.dtype)
    if want in (jnp.bfloat16, jnp.float32) and a.dtype != want and np.issubdtype(np.dtype(a.dtype), np.floating):
        cast = a.astype(want)  # transformers' layout may hold floats wider than the official dtype
        if not np.array_equal(cast.astype(np.float32), a.astype(np.float32), equal_nan=True):
            raise CheckpointError(f"{name}: stored as {a.dtype} with values not representable in {want.name}, "
                                  f"the dtype the official checkpoint uses")
        return cast
    if want == jnp.uint8:
        return a.view(np.uint8)
    if want == jnp.int32 and a.dtype != np.int32:
        if a.size and (a.min() < np.iinfo(np.int32).min or a.max() > np.iinfo(np.int32).max):
            raise CheckpointError(f"{name}: values out of int32 range")
        return a.astype(np.int32)
    return a


def _wo_a_dequantised(name: str, files, cfg: ModelConfig, info: ArrayInfo) -> np.ndarray:
    """The official checkpoint stores attn.wo_a in FP8; like convert.py we keep it dequantised in bf16."""
    sf = files[name]
    w = sf.get(name)
    if sf.dtype_name(name) == "BF16":
        return w
    scale_name = name[: -len("weight")] + "scale"
    if sf.dtype_name(name) != "F8_E4M3" or scale_name not in files:
        raise CheckpointError(f"{name}: expected BF16, or F8_E4M3 with {scale_name}; found {sf.dtype_name(name)} in {sf.path}")
    s = files[scale_name].get(scale_name).view(np.uint8)
    return quant.dequantize_fp8_blocks_np(w, s, cfg.weight_block_size).astype(ml_dtypes.bfloat16)


_FLOAT_TAGS = ("BF16", "F16", "F32", "F64")


def _check(name: str, files, info: ArrayInfo, shape) -> None:
    if name not in files:
        raise CheckpointError(f"{name}: missing from the checkpoint (expected shape {tuple(shape)}, {jnp.dtype(info.dtype).name})")
    sf = files[name]
    found_shape, tag = sf.shape(name), sf.dtype_name(name)
    if tuple(found_shape) != tuple(shape):
        raise CheckpointError(f"{name}: expected shape {tuple(shape)}, found {tuple(found_shape)} in {sf.path}")
    lenient = isinstance(sf, _ArrayFile) and jnp.dtype(info.dtype) in (jnp.bfloat16, jnp.float32) and tag in _FLOAT_TAGS
    if tag not in _STORED[jnp.dtype(info.dtype)] and not lenient:
        raise CheckpointError(f"{name}: expected dtype {'/'.join(_STORED[jnp.dtype(info.dtype)])}, found {tag} in {sf.path}")


def read_tree(files: dict, cfg: ModelConfig, *, put: Callable[[np.ndarray, ArrayInfo], Any] | None = None,
              progress: Callable[[int], None] | None = None):
    """Assemble the weight tree from `files` (name -> SafetensorsFile), validating every tensor."""
    put = put or (lambda a, info: jnp.asarray(a))
    tree = describe(cfg)
    used: set[str] = set()

    def load(path, info: ArrayInfo):
        name = official_name(path)
        if name.endswith("attn.wo_a.weight"):
            _check(name, files, ArrayInfo(info.shape, files[name].dtype_name(name) == "BF16" and jnp.bfloat16 or jnp.float8_e4m3fn, info.axes)
                   if name in files else info, info.shape)
            used.update({name, name[:-6] + "scale"})
            return put(_wo_a_dequantised(name, files, cfg, info), info)
        if "{e}" not in name:
            _check(name, files, info, info.shape)
            used.add(name)
            out = put(_convert(name, files[name].get(name), info), info)
            if progress:
                progress(1)
            return out
        E = info.shape[0]
        stacked = np.empty(info.shape, dtype=jnp.dtype(info.dtype))
        for e in range(E):
            n = name.replace("{e}", str(e))
            _check(n, files, info, info.shape[1:])
            used.add(n)
            stacked[e] = _convert(n, files[n].get(n), info)
        if progress:
            progress(E)
        return put(stacked, info)

    out = jax.tree_util.tree_map_with_path(load, tree, is_leaf=is_info)
    extra = sorted(set(files) - used)
    if extra:
        raise CheckpointError(f"{len(extra)} unexpected tensor(s) for {cfg.name}: {', '.join(extra[:5])}"
                              f"{' ...' if len(extra) > 5 else ''}")
    return out


def detect_layout(path: str) -> str:
    """'official' (inference-style names) or 'transformers' (save_pretrained names)."""
    files = safetensors_io.open_dir(path)
    names = list(files)
    if any(n.startswith("model.") or n.startswith("lm_head.") for n in names):
        return "transformers"
    return "official"


def load_params(path: str, cfg: ModelConfig | None = None, **kw):
    """Read a checkpoint directory (official or transformers layout) into the weight tree of `cfg`."""
    cfg = cfg or load_config(path)
    files = safetensors_io.open_dir(path)
    if detect_layout(path) == "transformers":
        files = _official_view_of_transformers(files, cfg)
    return read_tree(files, cfg, **kw)


class _ArrayFile:
    """Duck-types SafetensorsFile for tensors already in memory (the transformers -> official view)."""

    def __init__(self, arrays: dict[str, np.ndarray], tags: dict[str, str], path: str):
        self.arrays, self.tags, self.path = arrays, tags, path

    def get(self, name):
        return self.arrays[name]

    def shape(self, name):
        return tuple(self.arrays[name].shape)

    def dtype_name(self, name):
        return self.tags[name]


def _official_view_of_transformers(files: dict, cfg: ModelConfig) -> dict:
    from dsjax import transformers_layout as tl

    arrays, tags = {}, {}
    for name, sf in files.items():
        for off_name, arr in tl.transformers_to_official(name, sf.get(name)):
            arrays[off_name] = np.asarray(arr)
            tags[off_name] = sf.dtype_name(name) if arr.dtype == sf.get(name).dtype else safetensors_io._NAMES.get(np.dtype(arr.dtype), "F32")
    view = _ArrayFile(arrays, tags, next(iter(files.values())).path)
    return {n: view for n in arrays}
