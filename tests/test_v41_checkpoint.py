"""V4.1 checkpoints and Engram hashing: every tensor of the official layout (spec §5.3), vision tensors refused by
name when the config has no tower, and the n-gram hash constants and row ids equal to what DeepSeek's reference derived (the golden case)."""

import math
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsjax
from dsjax import checkpoint, safetensors_io
from dsjax.config import load_config
from dsjax.errors import CheckpointError
from dsjax.layers import engram as E
from dsjax.weights import describe, is_info
from golden_cases import discover

CASES = discover("v4.1")
_hash = jax.jit(E.hash_ids, static_argnums=0)
_next = jax.jit(E.next_history)
needs_case = pytest.mark.skipif(not CASES, reason="no V4.1 golden case in tests/data/goldens")


def test_v41_flash_tensor_inventory_matches_the_spec():
    """Our tree + the FP8 scale of each wo_a (dequantised at load) = 96,085 tensors, 266 of them vision's (spec §1);
    byte totals per dtype and the backbone / Engram / DSpark / vision parameter split as the spec reconciles them."""
    cfg = dsjax.preset("v4.1-flash")
    tensors, params, fp8_bytes, f32_bytes = 0, {"backbone": 0, "engram": 0, "dspark": 0, "vision": 0}, 0, 0
    vision = 0
    for path, info in jax.tree_util.tree_flatten_with_path(describe(cfg), is_leaf=is_info)[0]:
        name = checkpoint.official_name(path)
        tensors += info.shape[0] if "{e}" in name else 1
        vision += checkpoint._is_vision_tensor(name)
        size = math.prod(info.shape) * np.dtype(info.dtype).itemsize
        fp8_bytes += size if info.dtype == jnp.float8_e4m3fn else 0
        f32_bytes += size if info.dtype == jnp.float32 else 0
        if info.logical_shape or not jnp.issubdtype(info.dtype, jnp.integer):  # no scale arrays
            part = ("dspark" if name.startswith("mtp.") else "engram" if ".engram.embed." in name else
                    "vision" if checkpoint._is_vision_tensor(name) else "backbone")
            params[part] += math.prod(info.logical_shape or info.shape)
    wo_a = cfg.n_layers + cfg.n_mtp_layers
    assert tensors + wo_a == 96_085 and vision == 266
    assert round(params["vision"] / 1e9, 3) == 0.485
    assert fp8_bytes + wo_a * 8192 * 4096 == 204_015_223_296 and f32_bytes == 169_229_128
    assert round(params["backbone"] / 1e9, 3) == 551.881
    assert round(params["engram"] / 1e9, 3) == 196.614 and round(params["dspark"] / 1e9, 3) == 14.225


@needs_case
def test_golden_checkpoint_loads_every_tensor():
    """All 977 tensors of the case's official-layout file are consumed, with the stored formats kept."""
    case = CASES[0]
    cfg = load_config(case.path)
    files = safetensors_io.open_dir(case.path)
    seen = []
    p = checkpoint.read_tree(files, cfg, progress=seen.append)
    assert sum(seen) == len(files) == 977  # wo_a counts its scale too (dequantised into one bf16 leaf)
    eng = p.layers[1].engram
    assert eng.embed.weight.dtype == jnp.float8_e4m3fn and eng.embed.scale.shape == (630, 1)
    assert p.layers[4].engram.embed.weight.shape == (834, 32) and p.layers[2].engram is None
    assert p.layers[2].attn.compressor.wgate is not None and p.layers[6].attn.compressor.wgate is None
    assert p.layers[8].attn.indexer.wk is None and p.layers[3].attn.indexer is None
    assert p.layers[0].ffn.w1.fmt == "fp4" and p.mtp[0].main_proj.weight.shape == (64, 192)
    assert p.mtp[2].markov_head.embed.shape == (512, 16) and p.layers[0].ffn.gate_bias_vl is None


@needs_case
def test_vision_tensors_are_refused_by_name(tmp_path):
    case = CASES[0]
    shutil.copy(os.path.join(case.path, "config.json"), tmp_path / "config.json")
    files = safetensors_io.open_dir(case.path)
    tensors = {n: np.asarray(f.get(n)) for n, f in files.items()}
    tags = {n: f.dtype_name(n) for n, f in files.items() if f.dtype_name(n) in ("F8_E8M0", "I8")}
    tensors["vision.blocks.0.attn.qkv.weight"] = np.zeros((4, 4), np.float32)
    tensors["image_newline"] = np.zeros((64,), np.float32)
    safetensors_io.write(str(tmp_path / "model.safetensors"), tensors, dtype_names=tags)
    with pytest.raises(CheckpointError, match=r"2 vision-tower tensor\(s\) \(image_newline, vision.blocks.0.attn.qkv"
                                              r".weight\).*has no vision tower.*ignore_vision=True"):
        checkpoint.load_params(str(tmp_path))
    assert checkpoint.load_params(str(tmp_path), ignore_vision=True).layers[1].engram is not None
    with pytest.raises(CheckpointError, match="ignore_vision=True"):
        dsjax.load(str(tmp_path), compilation_cache=None)
    assert dsjax.load(str(tmp_path), ignore_vision=True, compilation_cache=None).cfg.family == "v4.1"


@needs_case
def test_wrong_engram_table_shape_is_named(tmp_path):
    case = CASES[0]
    cfg = load_config(case.path).replace(engram_num_embeddings=(631, 834))
    with pytest.raises(CheckpointError, match=r"layers.1.engram.embed.weight: expected shape \(631, 32\), found \(630, 32\)"):
        checkpoint.read_tree(safetensors_io.open_dir(case.path), cfg)


def test_engram_constants_of_v41_flash():
    """The released config: a 99,092-entry map from the real tokenizer, 48 distinct primes from 16,000,057 on,
    and per-layer prime sums equal to engram_num_embeddings (engram_constants checks the sums itself)."""
    cfg = dsjax.preset("v4.1-flash")
    token_map, size = E.compressed_token_map()
    assert size == 99_092 == cfg.engram_compressed_vocab_size and len(token_map) == 129_280
    c = E.engram_constants(cfg)
    assert c.primes.shape == (2, 3, 8) and len(set(c.primes.ravel().tolist())) == 48
    assert c.primes.ravel()[:3].tolist() == [16000057, 16000079, 16000081]
    assert np.all(np.diff(c.primes.ravel()) > 0) and c.offsets[:, 0].tolist() == [0, 0]
    assert c.primes.reshape(2, -1).sum(axis=1).tolist() == [384006168, 384016682]


@needs_case
def test_engram_hash_ids_equal_the_reference(test_seed):
    """Constants and row ids equal the reference's (int64 in numpy; uint32 on the device, any chunking)."""
    case = CASES[0]
    cfg = load_config(case.path)
    gold, inputs = case.golden("bf16"), case.inputs()
    c = E.engram_constants(cfg)
    assert np.array_equal(c.token_map, gold["short/engram_token_map"])
    assert np.array_equal(c.primes, gold["short/engram_primes"]) and np.array_equal(c.offsets, gold["short/engram_offsets"])
    assert np.array_equal(c.multipliers, gold["short/engram_multipliers"])
    rng = np.random.default_rng(test_seed)
    for prompt in ("short", "long"):
        ids = inputs[f"{prompt}_tokens"].astype(np.int32)
        ref = gold[f"{prompt}/engram_hash_ids"]
        assert np.array_equal(E.hash_ids_reference(cfg, ids), ref)
        history, got, at = E.initial_history(cfg, ids.shape[0]), [], 0
        while at < ids.shape[1]:  # random chunk lengths, as prefill chunks and decode steps would cut it
            chunk = jnp.asarray(ids[:, at:at + int(rng.choice([1, 2, 5, 32]))])
            got.append(np.asarray(_hash(cfg, history, chunk)))
            history = _next(history, chunk, jnp.full((ids.shape[0],), chunk.shape[1]))
            at += chunk.shape[1]
        assert np.array_equal(np.concatenate(got, axis=1), ref), prompt
