"""Checkpoints: the official DeepSeek layout (and transformers' layout) <-> the weight pytree.

Names come from the weight tree itself (`official_name`), so loading checks every tensor the config implies:
present, of the right shape, of the right dtype — and nothing unexpected. Tensors stream one at a time from
memory-mapped shards; stacked experts are assembled from their per-expert tensors. Given shardings, each device's
slice is read on its own (pread, no mapped pages left resident), so host memory stays at about one leaf.
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

_AS_IS = {"ape", "attn_sink", "tid2eid", "bias", "bias_vl", "q_weight", "k_weight",  # V4.1: gate.bias_vl, engram.q/k_weight
          "image_start", "image_end", "image_newline",                                # V4.1 vision: the span vectors
          "vocab_ids"}                                                                # reduced vocabulary's row ids
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


def _wo_a_dequantised(name: str, files, cfg: ModelConfig, info: ArrayInfo, index: tuple | None = None) -> np.ndarray:
    """The official checkpoint stores attn.wo_a in FP8; like convert.py we keep it dequantised in bf16.
    With `index` (a shard's slices) only the 128-row blocks that cover the shard's rows are read."""
    if name not in files:
        raise CheckpointError(f"{name}: missing from the checkpoint (expected shape {info.shape}, FP8 or BF16)")
    sf = files[name]
    if tuple(sf.shape(name)) != tuple(info.shape):
        raise CheckpointError(f"{name}: expected shape {info.shape}, found {tuple(sf.shape(name))} in {sf.path}")
    if sf.dtype_name(name) == "BF16":
        return _fetch(sf, name, index)
    scale_name = name[: -len("weight")] + "scale"
    if sf.dtype_name(name) != "F8_E4M3" or scale_name not in files:
        raise CheckpointError(f"{name}: expected BF16, or F8_E4M3 with {scale_name}; found {sf.dtype_name(name)} in {sf.path}")
    B, rows = cfg.weight_block_size, info.shape[0]
    found, want = tuple(files[scale_name].shape(scale_name)), tuple(-(-n // B) for n in info.shape)
    if found != want:  # a scale grid that does not fit the weight's blocks
        raise CheckpointError(f"{scale_name}: cannot dequantise {name} with it (scale shape {found}, expected {want} "
                              f"for blocks of {B}) in {files[scale_name].path}")
    r0, r1, _ = (index[0] if index else slice(None)).indices(rows)
    b0, b1 = r0 // B, -(-r1 // B)
    w = _fetch(sf, name, None if index is None else (slice(b0 * B, min(b1 * B, rows)),))
    s = _fetch(files[scale_name], scale_name, None if index is None else (slice(b0, b1),)).view(np.uint8)
    _check_scale_bytes(scale_name, s, files[scale_name].path)
    out = quant.dequantize_fp8_blocks_np(w, s, B).astype(ml_dtypes.bfloat16)
    return out if index is None else out[(slice(r0 - b0 * B, r1 - b0 * B),) + tuple(index[1:])]


def _fetch(sf, name: str, index: tuple | None) -> np.ndarray:
    """The whole tensor as a view of the memory map (index None), or a fresh array of just tensor[index]."""
    return sf.get(name) if index is None else sf.read(name, index)


def _check_scale_bytes(name: str, scale_u8: np.ndarray, path: str) -> None:
    """E8M0 byte 255 is NaN: refuse the checkpoint here rather than let it surface as NaN logits."""
    bad = scale_u8 == 255
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise CheckpointError(f"{name}: E8M0 scale byte 255 (NaN) at index {idx} ({int(bad.sum())} in total) in {path}; "
                              f"scales must be finite powers of two (bytes 0-254)")


_FLOAT_TAGS = ("BF16", "F16", "F32", "F64")


def _check(name: str, files, info: ArrayInfo, shape) -> None:
    if name not in files:
        raise CheckpointError(f"{name}: missing from the checkpoint (expected shape {tuple(shape)}, {jnp.dtype(info.dtype).name})")
    sf = files[name]
    found_shape, tag = sf.shape(name), sf.dtype_name(name)
    if tuple(found_shape) != tuple(shape):
        raise CheckpointError(f"{name}: expected shape {tuple(shape)}, found {tuple(found_shape)} in {sf.path}")
    lenient = isinstance(sf, _RenamedFile) and jnp.dtype(info.dtype) in (jnp.bfloat16, jnp.float32) and tag in _FLOAT_TAGS
    if tag not in _STORED[jnp.dtype(info.dtype)] and not lenient:
        raise CheckpointError(f"{name}: expected dtype {'/'.join(_STORED[jnp.dtype(info.dtype)])}, found {tag} in {sf.path}")


def read_tree(files: dict, cfg: ModelConfig, *, put: Callable[[np.ndarray, ArrayInfo], Any] | None = None,
              shardings=None, progress: Callable[[int], None] | None = None, ignore_vision: bool = False):
    """Assemble the weight tree from `files` (name -> SafetensorsFile), validating every tensor.

    V4.1's vision tower (`vision.*`, `aligner.*`, `image_start/end/newline`) is loaded when the config has one
    (`vision_n_layers` > 0); `ignore_vision=True` skips its tensors (text-only use: `params.vision` stays None).
    Vision tensors in a checkpoint whose config has no tower are refused by name unless ignored.

    Without `shardings` each whole tensor goes through `put`. With `shardings` (a NamedSharding per leaf) each
    leaf is built by `jax.make_array_from_callback` from the slices its devices hold, read straight from the
    files: no leaf — least of all a stack of routed experts — is ever assembled whole on the host."""
    vision = sorted(n for n in files if _is_vision_tensor(n))
    if vision and not ignore_vision and not cfg.vision_enabled:  # refused before anything is read
        raise CheckpointError(f"{len(vision)} vision-tower tensor(s) ({', '.join(vision[:3])}"
                              f"{' ...' if len(vision) > 3 else ''}): the config of {cfg.name} has no vision tower "
                              f"(vision_n_layers=0, no vision_config); pass ignore_vision=True to load the text "
                              f"model without them")
    put = put or (lambda a, info: jnp.asarray(a))
    tree = describe(cfg)
    if ignore_vision:
        tree = without_vision(tree)
        shardings = None if shardings is None else without_vision(shardings)
    used: set[str] = set()

    def leaf_reader(name: str, info: ArrayInfo) -> tuple[Callable[[tuple | None], np.ndarray], int]:
        """Validate the leaf's tensors now; return read(index) -> the leaf's [index] (None: all), and their count."""
        if name.endswith("attn.wo_a.weight"):
            scale = name[: -len("weight")] + "scale"
            used.update({name, scale})
            return (lambda index: _wo_a_dequantised(name, files, cfg, info, index)), 2 if scale in files else 1

        def one(n: str, index) -> np.ndarray:
            a = _convert(n, _fetch(files[n], n, index), info)
            if n.endswith(".scale"):
                _check_scale_bytes(n, a, files[n].path)
            return a

        if "{e}" not in name:
            _check(name, files, info, info.shape)
            used.add(name)
            return (lambda index: one(name, index)), 1
        E = info.shape[0]
        names = [name.replace("{e}", str(e)) for e in range(E)]
        for n in names:
            _check(n, files, info, info.shape[1:])
        used.update(names)

        def stacked(index):  # only the experts of this shard, one tensor at a time
            experts = range(*(index[0] if index else slice(None)).indices(E))
            rest = None if index is None else tuple(index[1:])
            out = np.empty((len(experts),) + _index_shape(info.shape[1:], rest or ()), dtype=jnp.dtype(info.dtype))
            for i, e in enumerate(experts):
                out[i] = one(names[e], rest)
            return out

        return stacked, E

    def load(path, info: ArrayInfo, sharding=None):
        read, count = leaf_reader(official_name(path), info)
        out = put(read(None), info) if sharding is None else _make_sharded(info, sharding, read)
        if progress:
            progress(count)
        return out

    if shardings is None:
        out = jax.tree_util.tree_map_with_path(load, tree, is_leaf=is_info)
    else:
        out = jax.tree_util.tree_map_with_path(load, tree, shardings, is_leaf=is_info)
    extra = sorted(n for n in set(files) - used if not (ignore_vision and _is_vision_tensor(n)))
    if extra:
        raise CheckpointError(f"{len(extra)} unexpected tensor(s) for {cfg.name}: {', '.join(extra[:5])}"
                              f"{' ...' if len(extra) > 5 else ''}")
    return out


_VISION_FIELDS = ("vision", "aligner", "image_start", "image_end", "image_newline")


def without_vision(tree):
    """A V4.1 weight tree (or a tree of shardings) with the vision tower's fields set to None."""
    import dataclasses

    if all(hasattr(tree, f) for f in _VISION_FIELDS):
        return dataclasses.replace(tree, **dict.fromkeys(_VISION_FIELDS))
    return tree


def _is_vision_tensor(name: str) -> bool:
    """V4.1's vision tower and its image-span embeddings (spec §5.3, 266 tensors in the released checkpoint)."""
    return name.startswith(("vision.", "aligner.")) or name in ("image_start", "image_end", "image_newline")


def _index_shape(shape, index: tuple) -> tuple[int, ...]:
    """The shape of x[index] for an x of `shape`, without allocating x."""
    return tuple(np.broadcast_to(np.empty((), np.bool_), tuple(shape))[index].shape)


def _make_sharded(info: ArrayInfo, sharding, read: Callable[[tuple], np.ndarray]) -> jax.Array:
    """One leaf on its devices; devices holding the same slice (replicas) share one read."""
    cache: dict = {}

    def shard(index):
        key = tuple((s.start, s.stop, s.step) for s in index)
        if key not in cache:
            cache[key] = read(tuple(index))
        return cache[key]

    return jax.make_array_from_callback(tuple(info.shape), sharding, shard, dtype=jnp.dtype(info.dtype))


def detect_layout(files: dict) -> str:
    """'official' (inference-style names) or 'transformers' (save_pretrained names), from the tensor names."""
    if any(n.startswith("model.") or n.startswith("lm_head.") for n in files):
        return "transformers"
    return "official"


def checkpoint_config(path: str, cfg: ModelConfig | None = None) -> ModelConfig:
    """The config a checkpoint directory holds weights for: transformers' layout carries no MTP head."""
    cfg = cfg or load_config(path)
    if detect_layout(safetensors_io.open_dir(path)) == "transformers" and cfg.n_mtp_layers:
        cfg = cfg.replace(n_mtp_layers=0, compress_ratios=cfg.compress_ratios[: cfg.n_layers])
    return cfg


def load_params(path: str, cfg: ModelConfig | None = None, *, shardings=None, **kw):
    """Read a checkpoint directory (official or transformers layout) into the weight tree of `cfg`;
    with `shardings` (sharding.param_shardings) each array is read shard by shard straight onto the mesh."""
    cfg = checkpoint_config(path, cfg)
    files = safetensors_io.open_dir(path)
    if detect_layout(files) == "transformers":
        files = _official_view_of_transformers(files, cfg)
    if "progress" not in kw:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(files), desc=f"loading {os.path.basename(os.path.abspath(path))}", unit="tensor",
                   disable=len(files) < 1000, leave=False)
        with bar:
            return read_tree(files, cfg, shardings=shardings, progress=bar.update, **kw)
    return read_tree(files, cfg, shardings=shardings, **kw)


class _LazyTensor:
    """A tensor of a memory-mapped file, read (and sliced) only when asked: keeps the renamed view streaming."""

    def __init__(self, sf, name: str, index=()):
        self.sf, self.name, self.index = sf, name, index

    def __getitem__(self, idx):
        return _LazyTensor(self.sf, self.name, self.index + (idx if isinstance(idx, tuple) else (idx,)))

    @property
    def shape(self):
        return _index_shape(self.sf.shape(self.name), self.index)

    def load(self) -> np.ndarray:
        a = self.sf.get(self.name)
        return a[self.index] if self.index else a

    def read(self, index: tuple) -> np.ndarray:
        """self[index] read from the file alone: `index` composed with this view's own index (ints, slices)."""
        full, rest = [], list(index)
        for i, n in zip(self.index, self.sf.shape(self.name)):
            if isinstance(i, slice) and rest:
                r = range(*i.indices(n))[rest.pop(0)]
                i = slice(r.start, r.stop, r.step)
            full.append(i)
        return self.sf.read(self.name, tuple(full) + tuple(rest))


class _RenamedFile:
    """Duck-types SafetensorsFile for transformers' names seen under their official names."""

    def __init__(self, tensors: dict[str, _LazyTensor], path: str):
        self.tensors, self.path = tensors, path

    def get(self, name):
        return self.tensors[name].load()

    def read(self, name, index=()):
        return self.tensors[name].read(tuple(index))

    def shape(self, name):
        return self.tensors[name].shape

    def dtype_name(self, name):
        t = self.tensors[name]
        return t.sf.dtype_name(t.name)


def _official_view_of_transformers(files: dict, cfg: ModelConfig) -> dict:
    from dsjax import transformers_layout as tl

    tensors = {}
    for name, sf in files.items():
        layout = "internal" if "mlp.experts.gate_up_proj" in name or "mlp.experts.down_proj" in name else "saved"
        lazy = _LazyTensor(sf, name)
        if layout == "internal":  # fused experts: the split needs the expert count and the inner size
            arr_like = np.empty(sf.shape(name), dtype=np.bool_)
            for off_name, part in tl.transformers_to_official(name, arr_like, "internal"):
                e = int(off_name.split(".experts.")[1].split(".")[0])
                if name.endswith("down_proj"):
                    tensors[off_name] = lazy[e]
                else:
                    inter = sf.shape(name)[1] // 2
                    sl = slice(0, inter) if off_name.endswith("w1.weight") else slice(inter, 2 * inter)
                    tensors[off_name] = lazy[e, sl]
            continue
        for off_name, obj in tl.transformers_to_official(name, lazy, "saved"):
            tensors[off_name] = obj
    view = _RenamedFile(tensors, next(iter(files.values())).path)
    return {n: view for n in tensors}


# ---------------------------------------------------------------------- writing
def hf_config_dict(cfg: ModelConfig, *, quantized: bool) -> dict:
    """A Hub-style V4 config.json for `cfg` (the released key set), optionally with its FP8 quantization_config."""
    d = {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": 1, "head_dim": cfg.head_dim, "qk_rope_head_dim": cfg.rope_head_dim,
        "q_lora_rank": cfg.q_lora_rank, "o_groups": cfg.o_groups, "o_lora_rank": cfg.o_lora_rank,
        "n_routed_experts": cfg.n_routed_experts, "n_shared_experts": cfg.n_shared_experts,
        "num_experts_per_tok": cfg.n_activated_experts, "moe_intermediate_size": cfg.moe_inter_dim,
        "num_hash_layers": cfg.n_hash_layers, "scoring_func": cfg.score_func, "norm_topk_prob": True,
        "topk_method": "noaux_tc", "routed_scaling_factor": cfg.route_scale, "swiglu_limit": cfg.swiglu_limit,
        "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "compress_rope_theta": cfg.compress_rope_theta,
        "rope_scaling": {"type": "yarn", "factor": cfg.rope_factor, "original_max_position_embeddings": cfg.original_seq_len,
                         "beta_fast": cfg.beta_fast, "beta_slow": cfg.beta_slow},
        "max_position_embeddings": cfg.max_position_embeddings, "sliding_window": cfg.window_size,
        "compress_ratios": list(cfg.compress_ratios), "index_n_heads": cfg.index_n_heads,
        "index_head_dim": cfg.index_head_dim, "index_topk": cfg.index_topk, "hc_mult": cfg.hc_mult,
        "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters, "hc_eps": cfg.hc_eps, "num_nextn_predict_layers": cfg.n_mtp_layers,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    if cfg.head_vocab_size:  # dsjax's reduced-vocabulary models (not a released key)
        d["head_vocab_size"] = cfg.head_vocab_size
    if quantized:
        d["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                    "scale_fmt": "ue8m0", "weight_block_size": [cfg.weight_block_size] * 2}
        d["expert_dtype"] = cfg.expert_dtype
    return d


def official_tensors(params, cfg: ModelConfig, *, quantize: bool):
    """Yield (name, numpy array, safetensors dtype tag) for every official tensor of the weight tree."""
    from dsjax.layers.linear import dequantize

    def host(x):
        return np.asarray(jax.device_get(x))

    def linear_items(prefix: str, lin: Linear):
        if quantize and lin.fmt in ("fp8", "fp4"):
            w, s = host(lin.weight), host(lin.scale)
            yield prefix + ".weight", w.view(np.int8) if lin.fmt == "fp4" else w, "I8" if lin.fmt == "fp4" else "F8_E4M3"
            yield prefix + ".scale", s, "F8_E8M0"
        elif quantize and lin.fmt == "bf16" and cfg.weight_dtype == "fp8":
            q, s = quant.quantize_fp8_blocks(host(lin.weight).astype(np.float32), cfg.weight_block_size)
            yield prefix + ".weight", q, "F8_E4M3"
            yield prefix + ".scale", s, "F8_E8M0"
        else:
            yield prefix + ".weight", host(dequantize(lin, jnp.bfloat16)), "BF16"

    leaves = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, Linear))[0]
    for path, leaf in leaves:
        if leaf is None:
            continue
        if isinstance(leaf, Linear):
            name = official_name(path + (jax.tree_util.GetAttrKey("weight"),))[: -len(".weight")]
            stacked = "{e}" in name
            items = list(linear_items(name, leaf))
            for n, a, tag in items:
                if stacked:
                    for e in range(a.shape[0]):
                        yield n.replace("{e}", str(e)), a[e], tag
                else:
                    yield n, a, tag
            continue
        name = official_name(path)
        a = host(leaf)
        if name.endswith("attn.wo_a.weight") and quantize and cfg.weight_dtype == "fp8":
            q, s = quant.quantize_fp8_blocks(a.astype(np.float32), cfg.weight_block_size)
            yield name, q, "F8_E4M3"
            yield name[: -len("weight")] + "scale", s, "F8_E8M0"
        elif a.dtype == np.int32 and name.endswith("tid2eid"):
            yield name, a.astype(np.int64), "I64"
        else:
            yield name, a, None


def save_checkpoint(params, cfg: ModelConfig, path: str, *, layout: str = "official", quantize: bool = True) -> None:
    """Write `params` as config.json + model.safetensors in the official layout (FP8/FP4 + scales when
    `quantize`, else bf16) or in transformers 5.24's `save_pretrained` layout (float32, no MTP)."""
    if layout not in ("official", "transformers"):
        raise CheckpointError(f"unknown layout {layout!r}; choose 'official' or 'transformers'")
    os.makedirs(path, exist_ok=True)
    if layout == "official":
        tensors, tags = {}, {}
        for name, a, tag in official_tensors(params, cfg, quantize=quantize):
            tensors[name] = a
            if tag:
                tags[name] = tag
        safetensors_io.write(os.path.join(path, "model.safetensors"), tensors, dtype_names=tags,
                             metadata={"format": "pt", "writer": "dsjax"})
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(hf_config_dict(cfg, quantized=quantize and cfg.weight_dtype == "fp8"), f, indent=2)
        return
    from dsjax import transformers_layout as tl

    plain = {n: (a.astype(np.float32) if np.issubdtype(a.dtype, np.floating) else a)
             for n, a, _ in official_tensors(params, cfg, quantize=False)}
    tensors = tl.official_state_to_transformers(plain, layout="saved")
    safetensors_io.write(os.path.join(path, "model.safetensors"), tensors, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(tl.hf_config_from_official(hf_config_dict(cfg, quantized=False)), f, indent=2)
