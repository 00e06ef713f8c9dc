"""Checkpoints: official-layout and transformers-layout round trips, the bf16 variant, the stored formats against the
spec's formulas (§5.1, decoded here with numpy only), the golden checkpoint's dtypes, `dsjax convert` to Orbax,
and streaming reads.

One small V4 model (window, CSA and HCA layers, hash and score routing, MTP, FP8 linears, FP4 experts) is drawn
from the session seed and written once per layout. Every checkpoint directory is named `tiny-v4`, the name a
config read from disk takes, so loaded configs equal the original one.

Compiling a forward takes ~5 s on CPU, so the logits tests share two: logits are compared in numerics
"transformers" (fp32, no fake quantisation; the weights are what these tests are about), and they use the model
without its MTP layer (`NO_MTP`), which makes the bf16 official checkpoint and the transformers-layout one (which
has no MTP) the same config. The MTP tensors are covered by the bitwise round trip and the format checks.
"""

import dataclasses
import os

import jax
import ml_dtypes
import numpy as np
import pytest

import dsjax
from dsjax import checkpoint, safetensors_io
from dsjax.layers.linear import dequantize
from dsjax.params import init_params
from dsjax.weights import Linear, describe, is_info

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "goldens", "v4_tiny_s1234")
SMALL = dsjax.preset("tiny-v4", vocab_size=1024, n_layers=3, compress_ratios=(0, 4, 16, 0), n_hash_layers=1)
NO_MTP = SMALL.replace(n_mtp_layers=0, compress_ratios=(0, 4, 16))
SEQ = 40  # > index_topk CSA entries and two complete HCA groups, so the indexer and the compressors matter
NUMERICS = "transformers"

# ---------------------------------------------------------------------- the spec's formats, in numpy only
SPEC_FP4_TABLE = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                           -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float64)


def spec_e4m3(raw: np.ndarray) -> np.ndarray:
    """float8 e4m3fn bytes -> float64: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal."""
    b = raw.view(np.uint8).astype(np.int64)
    sign = np.where(b >> 7, -1.0, 1.0)
    e, m = (b >> 3) & 15, b & 7
    mag = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * np.exp2(e - 7.0))
    return np.where((e == 15) & (m == 7), np.nan, sign * mag)


def spec_e8m0(raw: np.ndarray) -> np.ndarray:
    b = raw.view(np.uint8).astype(np.float64)
    return np.where(b == 255, np.nan, np.exp2(b - 127))


def spec_fp8_dequant(w: np.ndarray, s: np.ndarray, block: int = 128) -> np.ndarray:
    """W[i, j] = e4m3(W[i, j]) * 2^(scale[i // B, j // B] - 127)."""
    out, inn = w.shape[-2:]
    i, j = np.arange(out)[:, None] // block, np.arange(inn)[None, :] // block
    return spec_e4m3(w) * spec_e8m0(s)[..., i, j]


def spec_fp4_dequant(packed: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Two codes per byte, low nibble = element 2k; W[i, j] = code(i, j) * 2^(scale[i, j // 32] - 127)."""
    p = packed.view(np.uint8)
    codes = np.empty(p.shape[:-1] + (2 * p.shape[-1],), np.uint8)
    codes[..., 0::2], codes[..., 1::2] = p & 0xF, p >> 4
    return SPEC_FP4_TABLE[codes] * np.repeat(spec_e8m0(s), 32, axis=-1)


def all_e4m3_values() -> np.ndarray:
    v = spec_e4m3(np.arange(256, dtype=np.uint8))
    return np.unique(v[np.isfinite(v)])


# ---------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def params(test_seed):
    return init_params(SMALL, test_seed)


@pytest.fixture(scope="module")
def token_ids(test_seed):
    return np.random.default_rng([test_seed, 1]).integers(0, SMALL.vocab_size, size=(2, SEQ), dtype=np.int32)


@pytest.fixture(scope="module")
def params_no_mtp(params):
    return dataclasses.replace(params, mtp=())


@pytest.fixture(scope="module")
def written(tmp_path_factory, params, params_no_mtp):
    """kind -> checkpoint directory (basename tiny-v4): "official" holds SMALL, the others NO_MTP."""
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for key, p, cfg, kw in [("official", params, SMALL, dict(layout="official")),
                            ("official-no-mtp", params_no_mtp, NO_MTP, dict(layout="official")),
                            ("bf16", params_no_mtp, NO_MTP, dict(layout="official", quantize=False)),
                            ("transformers", params, SMALL, dict(layout="transformers"))]:
        path = str(root / key / "tiny-v4")
        dsjax.save_checkpoint(p, cfg, path, **kw)
        out[key] = path
    return out


@pytest.fixture(scope="module")
def reference_logits(params_no_mtp, token_ids):
    """The original FP8/FP4 params' logits. Committed to the device like Orbax-restored arrays, so the Orbax model
    reuses this compilation (jit compiles committed and uncommitted arguments separately)."""
    committed = jax.device_put(params_no_mtp, jax.devices()[0])
    logits = np.asarray(dsjax.Model(NO_MTP.with_numerics(NUMERICS), committed).logits(token_ids))
    assert np.isfinite(logits).all() and logits.std() > 0.1
    return logits


def file_tensors(path: str) -> dict[str, tuple[str, np.ndarray]]:
    files = safetensors_io.open_dir(path)
    return {n: (sf.dtype_name(n), np.array(sf.get(n))) for n, sf in files.items()}


def leaves_with_names(tree):
    return [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def assert_bitwise_equal(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (name, a), (_, b) in zip(leaves_with_names(got), leaves_with_names(want)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, a.shape, b.dtype, b.shape)
        assert a.tobytes() == b.tobytes(), f"{name}: bytes differ"


# ---------------------------------------------------------------------- official layout
def test_official_round_trip_is_bitwise(written, params):
    model = dsjax.load(written["official"])
    assert model.cfg == SMALL
    assert_bitwise_equal(model.params, params)


def test_official_file_uses_the_release_names_and_dtypes(written):
    """Spot checks against the spec's tensor inventory (§5.1-5.2)."""
    t = file_tensors(written["official"])
    expect = {
        "embed.weight": ("BF16", (1024, 128)), "head.weight": ("BF16", (1024, 128)),
        "hc_head_fn": ("F32", (4, 512)), "hc_head_base": ("F32", (4,)), "hc_head_scale": ("F32", (1,)),
        "layers.0.attn.attn_sink": ("F32", (4,)),
        "layers.0.attn.wq_a.weight": ("F8_E4M3", (128, 128)), "layers.0.attn.wq_a.scale": ("F8_E8M0", (1, 1)),
        "layers.0.attn.wo_a.weight": ("F8_E4M3", (128, 256)), "layers.0.attn.wo_a.scale": ("F8_E8M0", (1, 2)),
        "layers.0.hc_attn_fn": ("F32", (24, 512)), "layers.0.hc_ffn_scale": ("F32", (3,)),
        "layers.0.ffn.gate.weight": ("BF16", (8, 128)), "layers.0.ffn.gate.tid2eid": ("I64", (1024, 2)),
        "layers.1.ffn.gate.bias": ("F32", (8,)),
        "layers.1.ffn.experts.7.w1.weight": ("I8", (128, 64)), "layers.1.ffn.experts.7.w1.scale": ("F8_E8M0", (128, 4)),
        "layers.1.ffn.experts.0.w2.weight": ("I8", (128, 64)),
        "layers.1.ffn.shared_experts.w2.weight": ("F8_E4M3", (128, 128)),
        "layers.1.attn.compressor.ape": ("F32", (4, 256)), "layers.1.attn.compressor.wkv.weight": ("BF16", (256, 128)),
        "layers.1.attn.indexer.wq_b.weight": ("F8_E4M3", (512, 128)),
        "layers.1.attn.indexer.weights_proj.weight": ("BF16", (8, 128)),
        "layers.1.attn.indexer.compressor.ape": ("F32", (4, 128)),
        "layers.2.attn.compressor.ape": ("F32", (16, 128)),
        "mtp.0.e_proj.weight": ("F8_E4M3", (128, 128)), "mtp.0.enorm.weight": ("BF16", (128,)),
        "mtp.0.hc_head_fn": ("F32", (4, 512)), "mtp.0.ffn.gate.bias": ("F32", (8,)),
        "mtp.0.attn.wkv.weight": ("F8_E4M3", (128, 128)),
    }
    got = {n: (t[n][0], t[n][1].shape) for n in expect if n in t}
    assert got == expect
    assert "layers.2.attn.indexer.wq_b.weight" not in t      # HCA layers have no indexer
    assert "layers.1.ffn.gate.tid2eid" not in t and "layers.0.ffn.gate.bias" not in t
    assert not any(n.startswith(("mtp.0.embed", "mtp.0.head")) for n in t)  # shared with the main model


def test_bf16_checkpoint_gives_identical_logits(written, params_no_mtp, token_ids, reference_logits):
    """quantize=False writes the exact dequantisation (e4m3 or e2m1 times a power of two fits bf16), so the bf16
    model computes with the same numbers as the FP8/FP4 one: identical logits, not merely close ones."""
    tags = {tag for tag, _ in file_tensors(written["bf16"]).values()}
    assert tags <= {"BF16", "F32", "I64"}, tags
    model = dsjax.load(written["bf16"], numerics=NUMERICS)
    assert (model.cfg.weight_dtype, model.cfg.expert_dtype) == ("bf16", "bf16")
    assert model.cfg == NO_MTP.with_numerics(NUMERICS).replace(weight_dtype="bf16", expert_dtype="bf16")

    def dense(x):
        return np.asarray(dequantize(x, np.float32)) if isinstance(x, Linear) else np.asarray(x).astype(np.float32)

    is_lin = lambda x: isinstance(x, Linear)  # noqa: E731
    for (name, a), (_, b) in zip(jax.tree_util.tree_flatten_with_path(model.params, is_leaf=is_lin)[0],
                                 jax.tree_util.tree_flatten_with_path(params_no_mtp, is_leaf=is_lin)[0]):
        np.testing.assert_array_equal(dense(a), dense(b), err_msg=jax.tree_util.keystr(name))
    np.testing.assert_array_equal(np.asarray(model.logits(token_ids)), reference_logits)


def test_transformers_layout_round_trip(written, token_ids, reference_logits):
    """transformers' save_pretrained layout (float32, fused names, no MTP) reads back to the same numbers."""
    names = set(file_tensors(written["transformers"]))
    assert any(n.startswith("model.layers.") for n in names) and not any(n.startswith("mtp.") for n in names)
    model = dsjax.load(written["transformers"], numerics=NUMERICS)
    assert model.cfg.n_mtp_layers == 0 and model.params.mtp == ()
    assert model.cfg == NO_MTP.with_numerics(NUMERICS).replace(weight_dtype="bf16", expert_dtype="bf16")
    np.testing.assert_array_equal(np.asarray(model.logits(token_ids)), reference_logits)


# ---------------------------------------------------------------------- formats against the spec
def test_written_fp8_and_fp4_decode_by_the_spec_formula(written, params):
    """Every F8_E4M3 and I8 tensor in the file, decoded with the spec's formulas in numpy, equals the weight the
    model computes with (dsjax's own dequantisation of the in-memory params), bit for bit."""
    t = file_tensors(written["official"])
    is_lin = lambda x: isinstance(x, Linear)  # noqa: E731
    checked = {"F8_E4M3": 0, "I8": 0}
    for path, lin in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_lin)[0]:
        if not isinstance(lin, Linear):
            continue
        name = checkpoint.official_name(path + (jax.tree_util.GetAttrKey("weight"),))[: -len(".weight")]
        ours = np.asarray(dequantize(lin, np.float32)).astype(np.float64)
        for e in range(ours.shape[0]) if "{e}" in name else [None]:
            n = name.replace("{e}", str(e))
            tag, w = t[n + ".weight"]
            _, s = t[n + ".scale"]
            decoded = spec_fp4_dequant(w, s) if tag == "I8" else spec_fp8_dequant(w, s)
            checked[tag] += 1
            np.testing.assert_array_equal(decoded, ours if e is None else ours[e], err_msg=n)
    assert checked["F8_E4M3"] >= 20 and checked["I8"] == 3 * 3 * 8 + 3 * 8  # 3 layers + MTP, 8 experts x w1/w2/w3


def test_writer_encodes_wo_a_by_the_spec(written, params):
    """wo_a lives in bf16 and the writer quantises it: scale byte = 127 + ceil(log2(amax / 448)) per 128x128
    block, and decoding gives back the bf16 weight exactly (it was drawn FP8-representable, like a release)."""
    t = file_tensors(written["official"])
    for layer in range(SMALL.n_layers):
        w = np.asarray(params.layers[layer].attn.wo_a).astype(np.float64)
        _, q = t[f"layers.{layer}.attn.wo_a.weight"]
        _, s = t[f"layers.{layer}.attn.wo_a.scale"]
        amax = np.abs(w.reshape(w.shape[0] // 128, 128, w.shape[1] // 128, 128)).max(axis=(1, 3))
        mant, expo = np.frexp(amax / 448.0)
        np.testing.assert_array_equal(s.view(np.uint8), 127 + np.where(mant == 0.5, expo - 1, expo))
        np.testing.assert_array_equal(spec_fp8_dequant(q, s), w)


def test_fp8_encoder_rounds_to_nearest(test_seed):
    """quantize_fp8_blocks (what the writer and init use) on fresh fp32 data: each block's byte is
    127 + ceil(log2(amax/448)), and each code is the nearest e4m3 value to w / scale."""
    from dsjax import quant
    w = np.random.default_rng([test_seed, 2]).standard_normal((200, 300)).astype(np.float32)
    w *= np.exp2(np.random.default_rng([test_seed, 3]).integers(-8, 8, size=(200, 1)))
    q, s = quant.quantize_fp8_blocks(w, 128)
    assert q.dtype == ml_dtypes.float8_e4m3fn and s.shape == (2, 3)
    for bi in range(2):
        for bj in range(3):
            blk = w[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128].astype(np.float64)
            mant, expo = np.frexp(np.abs(blk).max() / 448.0)
            assert s[bi, bj] == 127 + (expo - 1 if mant == 0.5 else expo)
    x = w.astype(np.float64) / spec_e8m0(s)[np.arange(200)[:, None] // 128, np.arange(300)[None, :] // 128]
    grid = all_e4m3_values()
    err = np.abs(spec_e4m3(q) - x)
    best = np.abs(grid[np.clip(np.searchsorted(grid, x), 1, len(grid) - 1) - 1] - x)
    best = np.minimum(best, np.abs(grid[np.clip(np.searchsorted(grid, x), 0, len(grid) - 1)] - x))
    np.testing.assert_array_equal(err, best)


def test_fp4_encoder_rounds_to_nearest(test_seed):
    from dsjax import quant
    w = np.random.default_rng([test_seed, 4]).standard_normal((16, 96)).astype(np.float32)
    packed, s = quant.quantize_fp4_packed(w, 32)
    assert packed.shape == (16, 48) and s.shape == (16, 3)
    mant, expo = np.frexp(np.abs(w.astype(np.float64)).reshape(16, 3, 32).max(-1) / 6.0)
    np.testing.assert_array_equal(s, 127 + np.where(mant == 0.5, expo - 1, expo))
    x = w.astype(np.float64) / np.repeat(spec_e8m0(s), 32, axis=-1)
    err = np.abs(spec_fp4_dequant(packed, np.full_like(s, 127)) - x)
    best = np.abs(SPEC_FP4_TABLE[None, None, :] - x[..., None]).min(-1)
    np.testing.assert_array_equal(err, best)
    # the nibble order: element 2k in the low nibble
    codes = np.array([[1, 15, 7, 8]], np.uint8)
    np.testing.assert_array_equal(quant.pack_fp4_codes(codes), [[0xF1, 0x87]])


# ---------------------------------------------------------------------- the golden checkpoint
def test_golden_loads_in_stored_dtypes():
    model = dsjax.load(GOLDEN)
    cfg, p = model.cfg, model.params
    assert (cfg.vocab_size, cfg.n_layers, cfg.expert_dtype) == (512, 6, "fp4")
    files = safetensors_io.open_dir(GOLDEN)

    def stored(name):
        return np.array(files[name].get(name))

    attn, ffn = p.layers[3].attn, p.layers[3].ffn
    assert attn.wq_a.weight.dtype == ml_dtypes.float8_e4m3fn and attn.wq_a.scale.dtype == np.uint8
    assert attn.wq_a.fmt == "fp8" and attn.wq_a.block == 128
    assert np.asarray(attn.wq_a.weight).tobytes() == stored("layers.3.attn.wq_a.weight").tobytes()
    assert np.asarray(attn.wq_a.scale).tobytes() == stored("layers.3.attn.wq_a.scale").tobytes()
    # FP4 experts: packed uint8 [E, out, in/2] stacked from the per-expert I8 tensors, uint8 scales [E, out, in/32]
    assert ffn.w1.fmt == "fp4" and ffn.w1.weight.dtype == np.uint8 and ffn.w1.weight.shape == (8, 128, 64)
    assert ffn.w1.scale.dtype == np.uint8 and ffn.w1.scale.shape == (8, 128, 4)
    assert ffn.w2.weight.shape == (8, 128, 64)
    for e in (0, 5):
        assert np.asarray(ffn.w1.weight[e]).tobytes() == stored(f"layers.3.ffn.experts.{e}.w1.weight").tobytes()
        assert np.asarray(ffn.w2.scale[e]).tobytes() == stored(f"layers.3.ffn.experts.{e}.w2.scale").tobytes()
    # wo_a: stored FP8, held dequantised in bf16 (as convert.py does), exactly the spec's decode
    assert attn.wo_a.dtype == ml_dtypes.bfloat16 and attn.wo_a.shape == (128, 256)
    want = spec_fp8_dequant(stored("layers.3.attn.wo_a.weight"), stored("layers.3.attn.wo_a.scale"))
    np.testing.assert_array_equal(np.asarray(attn.wo_a).astype(np.float64), want)
    # the rest as stored: bf16, f32, int32 tid2eid (I64 in the file)
    assert p.embed.dtype == ml_dtypes.bfloat16 and ffn.gate.dtype == ml_dtypes.bfloat16
    assert ffn.gate_bias.dtype == np.float32 and p.layers[3].hc_attn.fn.dtype == np.float32
    tid2eid = p.layers[0].ffn.tid2eid
    assert tid2eid.dtype == np.int32 and tid2eid.shape == (512, 2)
    np.testing.assert_array_equal(np.asarray(tid2eid), stored("layers.0.ffn.gate.tid2eid"))
    assert len(p.mtp) == 1 and p.mtp[0].e_proj.weight.dtype == ml_dtypes.float8_e4m3fn


# ---------------------------------------------------------------------- dsjax convert -> Orbax
@pytest.mark.parametrize("kind", ["official", "official-no-mtp"])
def test_convert_to_orbax(written, params, params_no_mtp, token_ids, reference_logits, tmp_path, capsys, kind):
    from dsjax import cli, orbax_io
    cfg, original = (SMALL, params) if kind == "official" else (NO_MTP, params_no_mtp)
    dst = str(tmp_path / "orbax")
    assert cli.main(["convert", written[kind], dst]) == 0
    assert dst in capsys.readouterr().out
    assert orbax_io.is_orbax_dir(dst)
    assert dsjax.load(dst).cfg == cfg  # the config travels with the arrays (default numerics)
    model = dsjax.load(dst, numerics=NUMERICS)
    assert model.cfg == cfg.with_numerics(NUMERICS)
    assert_bitwise_equal(model.params, original)
    if kind == "official":
        return  # the MTP-less twin below checks the logits against the shared compilation
    np.testing.assert_array_equal(np.asarray(model.logits(token_ids)), reference_logits)


# ---------------------------------------------------------------------- streaming
def test_loading_streams_from_the_memory_map(written):
    """read_tree hands each tensor to `put` one at a time, straight from the file's memory map (no host copy of
    the checkpoint): stored-format tensors arrive as views of the mapped file."""
    calls = []

    def backed_by_map(a):
        while a is not None:
            if isinstance(a, np.memmap):
                return True
            a = getattr(a, "base", None)
        return False

    def put(a, info):
        calls.append((info.dtype, backed_by_map(a)))
        return a

    checkpoint.load_params(written["official"], SMALL, put=put)
    assert len(calls) == len(jax.tree.leaves(describe(SMALL), is_leaf=is_info))
    fp8_views = [mapped for dtype, mapped in calls if np.dtype(dtype) == ml_dtypes.float8_e4m3fn]
    assert fp8_views and all(fp8_views)
