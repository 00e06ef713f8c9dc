"""Errors users can act on: each bad input raises dsjax's own error type, naming the offending thing and what was
expected (style.md, "Errors users can act on").

Checkpoint corruptions are made by rewriting a small valid checkpoint's model.safetensors with
dsjax.safetensors_io.write, changing exactly one tensor. No forward pass runs here: every check happens before.
"""

import argparse
import json
import os
import re
import shutil

import ml_dtypes
import numpy as np
import pytest

import dsjax
from dsjax import safetensors_io
from dsjax.config import config_from_dict, kernels_arg, load_config
from dsjax.params import init_params

SMALL = dsjax.preset("tiny-v4", vocab_size=1024, n_layers=3, compress_ratios=(0, 4, 16, 0), n_hash_layers=1)


@pytest.fixture(scope="module")
def good(tmp_path_factory, test_seed):
    path = str(tmp_path_factory.mktemp("good") / "tiny-v4")
    dsjax.save_checkpoint(init_params(SMALL, test_seed), SMALL, path)
    dsjax.load(path)  # the unmodified checkpoint loads
    return path


@pytest.fixture
def corrupt(good, tmp_path):
    """corrupt(edit) -> a copy of the good checkpoint whose tensors went through edit(tensors, dtype_tags)."""

    def make(edit):
        path = str(tmp_path / "tiny-v4")
        shutil.copytree(good, path)
        f = safetensors_io.SafetensorsFile(os.path.join(good, "model.safetensors"))
        tensors = {n: np.array(f.get(n)) for n in f.names()}
        tags = {n: f.dtype_name(n) for n in f.names()}
        edit(tensors, tags)
        safetensors_io.write(os.path.join(path, "model.safetensors"), tensors, dtype_names=tags)
        return path

    return make


@pytest.fixture(scope="module")
def model():
    return dsjax.Model(SMALL, params=None)  # input checks run before the weights are touched


# ---------------------------------------------------------------------- names and paths
def test_unknown_preset():
    with pytest.raises(dsjax.ConfigError, match=r"unknown preset 'v5-flash'.*known presets: .*tiny-v4.*v4-flash"):
        dsjax.preset("v5-flash")


def test_load_unknown_name_or_missing_path(tmp_path):
    missing = str(tmp_path / "nowhere")
    with pytest.raises(dsjax.ConfigError, match=r"nowhere'? is neither a directory, a bundled checkpoint \(dsjax-small\) nor a known preset; presets: .*v4-flash"):
        dsjax.load(missing)
    with pytest.raises(dsjax.ConfigError, match=r"'v5-flash' is neither a directory, a bundled checkpoint"):
        dsjax.load("v5-flash")


def test_load_a_file_instead_of_a_directory(good):
    with pytest.raises(dsjax.ConfigError, match=r"config\.json: expected a checkpoint directory"):
        dsjax.load(os.path.join(good, "config.json"))


def test_directory_without_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(dsjax.ConfigError, match=rf"{re.escape(str(tmp_path))}: no config.json found"):
        dsjax.load(str(tmp_path))


def test_directory_without_safetensors(good, tmp_path):
    shutil.copy(os.path.join(good, "config.json"), tmp_path / "config.json")
    with pytest.raises(dsjax.CheckpointError, match=r"no \*\.safetensors files"):
        dsjax.load(str(tmp_path))


def test_preset_too_large_for_random_init():
    with pytest.raises(dsjax.ConfigError, match=r"preset 'v4-flash' needs .* GiB .* pass a checkpoint directory"):
        dsjax.load("v4-flash")


# ---------------------------------------------------------------------- malformed config.json
def write_config(directory, text):
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "config.json")
    with open(path, "w") as f:
        f.write(text)
    return path


def test_config_bad_json(tmp_path):
    path = write_config(tmp_path, '{"hidden_size": 128,')
    with pytest.raises(dsjax.ConfigError, match=rf"{re.escape(str(path))}: malformed JSON \(.*line 1"):
        load_config(str(tmp_path))


def test_config_json_is_a_list(tmp_path):
    path = write_config(tmp_path, "[1, 2, 3]")
    with pytest.raises(dsjax.ConfigError, match=rf"{re.escape(str(path))}: expected a JSON object, found list"):
        load_config(str(tmp_path))


def released_like(**changes) -> dict:
    from dsjax.checkpoint import hf_config_dict
    d = hf_config_dict(SMALL, quantized=True)
    d.update(changes)
    return d


def test_config_compress_ratios_too_short(tmp_path):
    """3 layers + 1 MTP need 4 ratios; a short list must not be padded with window layers silently."""
    path = write_config(tmp_path, json.dumps(released_like(compress_ratios=[0, 4])))
    want = rf"{re.escape(path)}: compress_ratios has 2 entries, expected .*3 \+ 1 = 4"
    with pytest.raises(dsjax.ConfigError, match=want):
        load_config(path)


def test_config_compress_ratios_wrong_length_in_python():
    with pytest.raises(dsjax.ConfigError, match=r"compress_ratios has 3 entries, expected n_layers \+ n_mtp_layers = 4"):
        SMALL.replace(compress_ratios=(0, 4, 16))


@pytest.mark.parametrize("key,field,value", [("hidden_size", "dim", -128), ("num_attention_heads", "n_heads", 0),
                                             ("moe_intermediate_size", "moe_inter_dim", -1),
                                             ("sliding_window", "window_size", -32)])
def test_config_non_positive_dims(tmp_path, key, field, value):
    path = write_config(tmp_path / "bad", json.dumps(released_like(**{key: value})))
    with pytest.raises(dsjax.ConfigError, match=rf"bad: {field} must be a positive int, got {value}"):
        load_config(path)


def test_config_negative_compress_ratio():
    with pytest.raises(dsjax.ConfigError, match=r"compress ratio -4 must be a non-negative int"):
        config_from_dict(released_like(compress_ratios=[0, -4, 16, 0]))


def test_config_inconsistent_fields():
    with pytest.raises(dsjax.ConfigError, match=r"n_heads 4 must be divisible by o_groups 3"):
        SMALL.replace(o_groups=3)
    with pytest.raises(dsjax.ConfigError, match=r"unknown score_func 'relu'"):
        config_from_dict(released_like(scoring_func="relu"))
    with pytest.raises(dsjax.ConfigError, match=r"weight_block_size must be a square \[B, B\], found \[128, 64\]"):
        config_from_dict(released_like(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 64]}))


def test_malformed_config_surfaces_through_load(good, tmp_path):
    path = str(tmp_path / "tiny-v4")
    shutil.copytree(good, path)
    write_config(path, "[]")
    with pytest.raises(dsjax.ConfigError, match=r"config.json: expected a JSON object, found list"):
        dsjax.load(path)


# ---------------------------------------------------------------------- corrupt checkpoints
def test_missing_tensor(corrupt):
    path = corrupt(lambda t, g: t.pop("layers.1.attn.wkv.weight"))
    with pytest.raises(dsjax.CheckpointError,
                       match=r"layers\.1\.attn\.wkv\.weight: missing from the checkpoint \(expected shape \(128, 128\), "
                             r"float8_e4m3fn\)"):
        dsjax.load(path)


def test_missing_expert(corrupt):
    path = corrupt(lambda t, g: t.pop("layers.2.ffn.experts.5.w2.scale"))
    with pytest.raises(dsjax.CheckpointError, match=r"layers\.2\.ffn\.experts\.5\.w2\.scale: missing .*\(128, 4\), uint8"):
        dsjax.load(path)


def test_misshapen_tensor(corrupt):
    def edit(t, g):
        t["layers.2.attn.kv_norm.weight"] = t["layers.2.attn.kv_norm.weight"][:-1]

    path = corrupt(edit)
    with pytest.raises(dsjax.CheckpointError,
                       match=r"layers\.2\.attn\.kv_norm\.weight: expected shape \(128,\), found \(127,\) "
                             r"in .*model\.safetensors"):
        dsjax.load(path)


def test_wrong_dtype(corrupt):
    """BF16 where the release stores F8_E4M3."""
    name = "layers.0.attn.wq_b.weight"

    def edit(t, g):
        t[name] = t[name].astype(np.float32).astype(ml_dtypes.bfloat16)
        g[name] = "BF16"

    path = corrupt(edit)
    want = rf"{re.escape(name)}: expected dtype F8_E4M3, found BF16 in .*model\.safetensors"
    with pytest.raises(dsjax.CheckpointError, match=want):
        dsjax.load(path)


def test_wrong_dtype_for_fp4_expert(corrupt):
    name = "layers.1.ffn.experts.0.w1.weight"

    def edit(t, g):
        t[name] = t[name].view(np.uint8).astype(np.int16)
        g[name] = "I16"

    path = corrupt(edit)
    with pytest.raises(dsjax.CheckpointError, match=rf"{re.escape(str(name))}: expected dtype F8_E8M0/I8/U8, found I16"):
        dsjax.load(path)


def test_unexpected_extra_tensor(corrupt):
    path = corrupt(lambda t, g: t.update({"layers.1.attn.wq_c.weight": np.zeros((4, 4), np.float32)}))
    with pytest.raises(dsjax.CheckpointError, match=r"1 unexpected tensor\(s\) for tiny-v4: layers\.1\.attn\.wq_c\.weight"):
        dsjax.load(path)


def test_nan_scale_in_wo_a(corrupt):
    """E8M0 byte 255 is NaN. wo_a is dequantised at load, so the NaN must be refused there, by name."""
    name = "layers.1.attn.wo_a.scale"

    def edit(t, g):
        t[name] = t[name].copy()
        t[name][0, 1] = 255

    path = corrupt(edit)
    want = rf"{re.escape(name)}: E8M0 scale byte 255 \(NaN\) at index \(0, 1\) .*bytes 0-254"
    with pytest.raises(dsjax.CheckpointError, match=want):
        dsjax.load(path)


@pytest.mark.parametrize("name", ["layers.0.attn.wq_a.scale", "layers.2.ffn.experts.3.w1.scale"])
def test_nan_scale_in_kept_fp8_and_fp4_weights(corrupt, name):
    """Weights kept in FP8/FP4 are dequantised per matmul; a NaN scale would only show up as NaN logits."""

    def edit(t, g):
        t[name] = t[name].copy()
        t[name].reshape(-1)[-1] = 255

    path = corrupt(edit)
    with pytest.raises(dsjax.CheckpointError, match=rf"{re.escape(str(name))}: E8M0 scale byte 255 \(NaN\)"):
        dsjax.load(path)


def test_truncated_safetensors(good, tmp_path):
    path = str(tmp_path / "tiny-v4")
    shutil.copytree(good, path)
    with open(os.path.join(path, "model.safetensors"), "r+b") as f:
        f.truncate(4)
    with pytest.raises(dsjax.CheckpointError, match=r"model\.safetensors: not a readable safetensors file"):
        dsjax.load(path)


def test_unknown_save_layout(tmp_path):
    with pytest.raises(dsjax.CheckpointError, match=r"unknown layout 'hf'; choose 'official' or 'transformers'"):
        dsjax.save_checkpoint(None, SMALL, str(tmp_path), layout="hf")


# ---------------------------------------------------------------------- Model.logits inputs
@pytest.mark.parametrize("ids,pattern", [
    ([[5, 1024]], r"token id 1024 at \[0, 1\] is out of range \[0, 1024\)"),
    ([[5, 3], [2, -1]], r"token id -1 at \[1, 1\] is out of range \[0, 1024\)"),
    (np.array([[1.0, 2.0]]), r"token_ids must be integers, got dtype float64"),
    (np.array([[True, False]]), r"token_ids must be integers, got dtype bool"),
    ([], r"token_ids must be a non-empty \[batch, seq\] array of ints, got shape \(1, 0\)"),
    (np.zeros((2, 0), np.int32), r"non-empty \[batch, seq\] .* got shape \(2, 0\)"),
    (np.zeros((1, 2, 3), np.int32), r"\[batch, seq\] .* got shape \(1, 2, 3\)"),
])
def test_bad_token_ids(model, ids, pattern):
    with pytest.raises(dsjax.InputError, match=pattern):
        model.logits(ids)


@pytest.mark.parametrize("positions", [[3], [-1], [0, 7]])
def test_positions_out_of_range(model, positions):
    with pytest.raises(dsjax.InputError, match=r"positions must lie in \[0, 3\), got " + re.escape(str(positions))):
        model.logits([[1, 2, 3]], positions=positions)


# ---------------------------------------------------------------------- load options
def test_unknown_numerics():
    want = r"unknown numerics 'fp8'; choose one of transformers, reference-bf16, reference-fp8"
    with pytest.raises(dsjax.ConfigError, match=want):
        dsjax.load("tiny-v4", numerics="fp8")
    with pytest.raises(dsjax.ConfigError, match=r"unknown numerics 'fast'"):
        SMALL.with_numerics("fast")


def test_unknown_kernels():
    with pytest.raises(dsjax.ConfigError, match=r"unknown kernels 'cuda'; choose one of auto, pallas, xla, reference"):
        dsjax.load("tiny-v4", kernels="cuda")
    for bad, why in [("auto+chunk=pallas", "bad kernel override 'chunk=pallas'"),
                     ("auto+moe_gemm=triton", "bad kernel override 'moe_gemm=triton'"),
                     ("auto+moe_gemm", "write OP=pallas or OP=xla, OP one of chunk_attention, ")]:
        with pytest.raises(dsjax.ConfigError, match=re.escape(why)):
            dsjax.load("tiny-v4", kernels=bad)
    with pytest.raises(argparse.ArgumentTypeError, match="unknown kernels 'cuda'"):
        kernels_arg("cuda")
    assert kernels_arg("auto+moe_gemm=xla") == "auto+moe_gemm=xla"


def test_max_seq_len_past_the_positions_names_the_limit():
    """A too-long context is a ConfigError that also carries the limit (callers such as `bench repro` read it)."""
    from dsjax.errors import ContextLimitError

    with pytest.raises(ContextLimitError, match=r"max_seq_len 8192 must lie in \[2, 4096\] for dsjax-small") as e:
        dsjax.load("dsjax-small", max_seq_len=8192)
    assert e.value.limit == 4096 and isinstance(e.value, dsjax.ConfigError)


def test_every_error_is_a_dsjax_error_and_a_value_error():
    for cls in (dsjax.ConfigError, dsjax.CheckpointError, dsjax.InputError):
        assert issubclass(cls, dsjax.DsjaxError) and issubclass(cls, ValueError)
