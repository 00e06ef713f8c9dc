# %% [markdown]
# # Checkpoints and quantisation: FP8 and FP4 in the V4 family
#
# DeepSeek releases V4-Flash and V4.1-Flash in low-precision formats, and the reference *computes* with some of
# them too (the KV caches and index keys hold fake-quantised values). dsjax keeps weights on the device in
# their checkpoint formats and reproduces the reference's fake quantisation bit for bit (`dsjax/quant.py`).
# This notebook looks at those formats with the library's own codecs:
#
# 1. **round trips** — quantise, dequantise, quantise again: what a format loses once, and that it loses
#    nothing more after that (why saving and loading a checkpoint is exact);
# 2. **error histograms** — FP8 e4m3 vs FP4 e2m1, power-of-two vs e4m3 scales, block size, and why the
#    indexer rotates its vectors (Hadamard) before FP4;
# 3. **memory per format** — bytes per value with the scales, and the V4-Flash / V4.1-Flash weights by format;
# 4. **a checkpoint round trip** through `dsjax.save_checkpoint` and `dsjax.load` on a tiny model.
#
# | format | values | scale | block | where |
# |---|---|---|---|---|
# | FP8 e4m3 + ue8m0 | 1 byte, max 448 | power of two (1 byte, E8M0) | 128 x 128 (V4), 32 x 32 (V4.1) | linear weights |
# | FP4 e2m1 packed + ue8m0 | ½ byte, {0, ±0.5, …, ±6} | power of two | 1 x 32 | routed experts; index keys and queries (after a Hadamard rotation) |
# | FP8 e4m3 (fake quant) | | power of two | 64 (V4), 32 (V4.1) | main KV cache (non-rope dims), optionally activations |
# | FP4 e2m1 + e4m3 scale | ½ byte | an e4m3 number (1 byte) | 16 | V4.1 main compressed KV (288-byte rows) |

# %%
import os
import shutil
import tempfile

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

import dsjax
from dsjax import quant, safetensors_io
from dsjax.params import init_params
from dsjax.weights import Linear, describe, is_info

rng = np.random.default_rng(0)


def sqnr_db(x, y):
    """Signal-to-quantisation-noise ratio of y as an approximation of x, in dB."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return 10 * np.log10(np.sum(x ** 2) / np.sum((x - y) ** 2))

# %% [markdown]
# ## 1. Round trips of the checkpoint codecs
#
# A linear weight drawn like a trained one (normal, std 1/√fan-in) is encoded as the checkpoint stores it — FP8
# e4m3 values with one E8M0 exponent byte per 128 x 128 block, or FP4 codes packed two per byte (low nibble
# first) with one E8M0 byte per 32 values — and decoded back. The first trip rounds; the decoded weight is then
# exactly representable, so encoding it again and decoding reproduces the same values: the stored form is a
# fixed point. (Not always the same *bytes*: when a block's largest value rounded to a code a binade below the
# grid's top — 3 instead of 6 — the re-encoder picks a scale half as large and doubles the codes.)

# %%
w = rng.normal(0, 1024 ** -0.5, (512, 1024)).astype(np.float32)

q8, s8 = quant.quantize_fp8_blocks(w, 128)
w8 = quant.dequantize_fp8_blocks(q8, s8, 128)
q8b, s8b = quant.quantize_fp8_blocks(w8, 128)
print(f"FP8: values {q8.dtype} {q8.shape}, scales {s8.dtype} {s8.shape} (bytes = exponent + 127, e.g. {s8[0, :4]})")
w8b = quant.dequantize_fp8_blocks(q8b, s8b, 128)
print(f"     SQNR {sqnr_db(w, w8):.1f} dB; decode(encode(decoded)) == decoded: {np.array_equal(w8b, w8)}, "
      f"same bytes: {np.array_equal(q8.view(np.uint8), q8b.view(np.uint8)) and np.array_equal(s8, s8b)}")

q4, s4 = quant.quantize_fp4_packed(w, 32)
w4 = quant.dequantize_fp4_packed(q4, s4, 32)
q4b, s4b = quant.quantize_fp4_packed(w4, 32)
print(f"FP4: packed {q4.dtype} {q4.shape} (two codes per byte), scales {s4.shape} (one per 32 values)")
w4b = quant.dequantize_fp4_packed(q4b, s4b, 32)
print(f"     SQNR {sqnr_db(w, w4):.1f} dB; decode(encode(decoded)) == decoded: {np.array_equal(w4b, w4)}; "
      f"{np.mean(s4b != s4):.1%} of the blocks re-encoded with a scale 2x smaller "
      f"(never more: {np.all(s4b.astype(int) - s4 >= -1)})")
assert np.array_equal(w8b, w8) and np.array_equal(w4b, w4)

# the jit-able device path decodes the same bits as the numpy loader path
assert np.array_equal(np.asarray(quant.dequantize_fp4_packed(jnp.asarray(q4), jnp.asarray(s4), 32)), w4)

codes = quant.unpack_fp4_codes(q4[:1, :4])[0]
print(f"first byte 0x{q4[0, 0]:02x} -> codes {codes[0]}, {codes[1]} -> values {quant.FP4_CODE_TABLE[codes[:2]]} "
      f"x 2^{int(s4[0, 0]) - 127} = {w4[0, :2]} (original {w[0, :2]})")

# %% [markdown]
# The 16 FP4 codes are the signed grid {0, 0.5, 1, 1.5, 2, 3, 4, 6}: two mantissa steps per binade, so a value
# is kept to within 1/8–1/4 of its magnitude at best, and small values in a block with a large one round to 0.
# FP8 e4m3 has 8 steps per binade (3 mantissa bits). The next section shows what that costs.
#
# ## 2. Error histograms
#
# Left: the error of each value relative to its own block's largest value (what the scale adapts to), for the
# four formats on the same Gaussian data. Right: signal-to-noise ratio against the block size (values sharing
# one scale); each halving of the block doubles the scale bytes (§3).

# %%
x = rng.normal(0, 1, (256, 1024)).astype(np.float32)
variants = {
    "FP8 e4m3, ue8m0 scale / 128": (quant.fp8_e4m3_sim(x, 128), 128),
    "FP4 e2m1, e4m3 scale / 16 (V4.1 KV)": (quant.fp4_e2m1_sim(x, 16, scale_format="e4m3"), 16),
    "FP4 e2m1, ue8m0 scale / 16": (quant.fp4_e2m1_sim(x, 16), 16),
    "FP4 e2m1, ue8m0 scale / 32 (experts, index)": (quant.fp4_e2m1_sim(x, 32), 32),
}
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 3.8))
for name, (y, block) in variants.items():
    y = np.asarray(y)
    amax = np.abs(x.reshape(-1, block)).max(1, keepdims=True)
    rel = ((y - x).reshape(-1, block) / amax).ravel()
    ax1.hist(rel, bins=np.linspace(-0.12, 0.12, 241), histtype="step", density=True,
             label=f"{name}: SQNR {sqnr_db(x, y):.1f} dB")
    print(f"{name:<46} SQNR {sqnr_db(x, y):5.1f} dB, zeroed {np.mean((y == 0) & (x != 0)):.1%} of values")
ax1.set_yscale("log")
ax1.set_xlabel("error / block max |x|")
ax1.set_ylabel("density")
ax1.legend(fontsize=7, loc="lower center")

blocks = [8, 16, 32, 64, 128, 256, 512, 1024]
ax2.plot(blocks, [sqnr_db(x, quant.fp8_e4m3_sim(x, b)) for b in blocks], "o-", label="FP8 e4m3, ue8m0 scale")
ax2.plot(blocks, [sqnr_db(x, quant.fp4_e2m1_sim(x, b, scale_format="e4m3")) for b in blocks], "o-",
         label="FP4 e2m1, e4m3 scale")
ax2.plot(blocks, [sqnr_db(x, quant.fp4_e2m1_sim(x, b)) for b in blocks], "o-", label="FP4 e2m1, ue8m0 scale")
ax2.set_xscale("log", base=2)
ax2.set_xlabel("block size (values per scale)")
ax2.set_ylabel("SQNR (dB), Gaussian data")
ax2.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# FP8 sits about 11 dB above any FP4 variant, and its error does not depend on the block size at all: with 4
# exponent bits, e4m3 keeps its relative precision over a wide range, so the scale only has to prevent overflow.
# FP4 has 2 exponent bits; its scale decides which values land on the fine end of the grid, so smaller blocks
# help it. An **e4m3 scale** also beats a power-of-two one at the same block: a power-of-two scale must round
# *up* to keep the block's maximum inside ±6, leaving up to half the grid unused on some blocks, while an e4m3
# scale stays close to max/6 — V4.1's choice for its 16-value KV blocks.
#
# **Why the indexer rotates before FP4.** Activations have outlier channels. In a block that contains one, the
# scale follows the outlier and the other values fall on the coarse low end of the grid or to zero. The V4
# indexer multiplies its queries and keys by a normalised Hadamard matrix first (`quant.hadamard`), which is
# orthogonal — dot products, and so the scores, are unchanged — and spreads each outlier over the whole vector.
# Below: 128-d vectors (the index head size) with 4 outlier channels 20x larger than the rest.

# %%
v = rng.normal(0, 1, (4096, 128)).astype(np.float32)
v[:, [5, 37, 64, 100]] *= 20
k_ = rng.normal(0, 1, (4096, 128)).astype(np.float32)

plain = np.asarray(quant.fp4_e2m1_sim(v, 32))
hv = quant.hadamard(jnp.asarray(v))
rotated = np.asarray(quant.fp4_e2m1_sim(hv, 32))
back = np.asarray(quant.hadamard(jnp.asarray(rotated)))  # H/√n is symmetric and orthogonal: its own inverse

dots = np.sum(v * k_, 1)
rotated_dots = np.sum(np.asarray(hv) * np.asarray(quant.hadamard(jnp.asarray(k_))), 1)
print(f"Hadamard keeps dot products: max |Δ| {np.max(np.abs(rotated_dots - dots)):.1e}")
print(f"FP4 of the raw vectors:     SQNR {sqnr_db(v, plain):5.1f} dB, zeroed {np.mean(plain == 0):.0%} of values")
print(f"FP4 after the rotation:     SQNR {sqnr_db(v, back):5.1f} dB, zeroed {np.mean(rotated == 0):.0%} of values")
assert sqnr_db(v, back) > sqnr_db(v, plain) + 3

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 3.4))
ax1.plot(np.abs(v[0]), lw=1, label="|x| (4 outlier channels)")
ax1.plot(np.abs(np.asarray(hv)[0]), lw=1, label="|H x| / √n (rotated)")
ax1.set_xlabel("channel")
ax1.set_title("one vector before and after the rotation", fontsize=10)
ax1.legend(fontsize=8)
for y, label in ((plain, "FP4 of x"), (back, "FP4 of Hx, rotated back")):
    ax2.hist((y - v).ravel(), bins=np.linspace(-4, 4, 161), histtype="step", density=True,
             label=f"{label}: SQNR {sqnr_db(v, y):.1f} dB")
ax2.set_yscale("log")
ax2.set_xlabel("error (units of the non-outlier std)")
ax2.set_title("per-value error, FP4 e2m1 / 32, ue8m0", fontsize=10)
ax2.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 3. Memory per format
#
# Bytes per value including the scales:

# %%
per_value = {
    "fp32": 4.0,
    "bf16": 2.0,
    "FP8 e4m3 + ue8m0 / 128x128 (V4 weights)": 1 + 1 / 128 ** 2,
    "FP8 e4m3 + ue8m0 / 32x32 (V4.1 weights)": 1 + 1 / 32 ** 2,
    "FP8 e4m3 + ue8m0 / 64 (V4 KV, 448 dims)": 1 + 1 / 64,
    "FP4 e2m1 + e4m3 / 16 (V4.1 KV)": 0.5 + 1 / 16,
    "FP4 e2m1 + ue8m0 / 32 (experts, index keys)": 0.5 + 1 / 32,
}
for name, b in per_value.items():
    print(f"{name:<46} {b:7.4f} bytes/value   {b / 2:6.1%} of bf16")

# %% [markdown]
# Applied to the whole models: every array of `weights.describe(cfg)`, by the format dsjax holds it in on the
# device (the checkpoint's format, except `wo_a`, which the official loader also dequantises to bf16). No
# weights are allocated; this reads the description only.

# %%
def bytes_by_format(cfg):
    """Bytes of the weight description by stored format (Engram's FP8 tables and their scales apart)."""
    out = {}

    def add(kind, info):
        out[kind] = out.get(kind, 0) + int(np.prod(info.shape)) * np.dtype(info.dtype).itemsize

    tree = describe(cfg)
    nodes = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda n: isinstance(n, Linear) or is_info(n))[0]
    for path, node in nodes:
        if isinstance(node, Linear):
            add({"fp8": "FP8 e4m3", "fp4": "FP4 e2m1 (packed)", "bf16": "bf16"}[node.fmt], node.weight)
            if node.scale is not None:
                add("ue8m0 scales", node.scale)
        elif ".engram.embed." in jax.tree_util.keystr(path):
            add("Engram tables (FP8 e4m3)" if node.dtype == jnp.float8_e4m3fn else "ue8m0 scales", node)
        else:
            add({"bfloat16": "bf16", "float32": "fp32"}.get(np.dtype(node.dtype).name, "other (int)"), node)
    return out


V4, V41 = dsjax.preset("v4-flash"), dsjax.preset("v4.1-flash")
formats = {cfg.name: bytes_by_format(cfg) for cfg in (V4, V41)}
kinds = sorted({k for f in formats.values() for k in f}, key=lambda k: -formats["v4-flash"].get(k, 0))
for name, f in formats.items():
    total = sum(f.values())
    print(f"{name}: {total / 1e9:.1f} GB held on the device")
    for k in kinds:
        if f.get(k):
            print(f"  {k:<26} {f[k] / 1e9:8.2f} GB  {f[k] / total:6.1%}")

fig, ax = plt.subplots(figsize=(10, 2.8))
for name, f in formats.items():
    left = 0
    for i, k in enumerate(kinds):
        ax.barh(name, f.get(k, 0) / 1e9, left=left, color=f"C{i}", label=k if name == "v4-flash" else None)
        left += f.get(k, 0) / 1e9
    ax.text(left, name, f"  {left:.0f} GB", va="center")
ax.set_xlabel("GB of weights on the device, by stored format")
ax.set_xlim(0, max(sum(f.values()) for f in formats.values()) / 1e9 * 1.15)
ax.legend(fontsize=8, ncol=len(kinds), loc="upper center", bbox_to_anchor=(0.5, 1.32), frameon=False)
fig.tight_layout()
plt.show()

# %% [markdown]
# The routed experts in packed FP4 are most of V4-Flash (88%); in bf16 they alone would take 4x their 142 GB.
# V4.1-Flash adds its Engram tables — n-gram embeddings of 768M rows stored in FP8 — which hold 38% of its
# bytes but are only *looked up* (a few rows per token), never streamed like the weights; `dsjax plan` splits
# them over all devices.
#
# ## 4. A checkpoint round trip
#
# `dsjax.save_checkpoint` writes the official layout — `config.json` and `model.safetensors` with FP8
# `F8_E4M3` weights, packed-FP4 `I8` experts and `F8_E8M0` scales — and `dsjax.load` reads it back tensor by
# tensor, checking every name, shape and dtype. Since the weights were already in those formats, the trip
# must be exact. We use `tiny-v4` with a 4,096-token vocabulary to keep the files small, and write the same
# weights once more unquantised (bf16) to compare sizes.

# %%
cfg = dsjax.preset("tiny-v4", vocab_size=4096)
params = init_params(cfg, seed=0)
tmp = tempfile.mkdtemp(prefix="dsjax-nb-ckpt-")
quantised, plain_dir = os.path.join(tmp, "official-fp8-fp4"), os.path.join(tmp, "official-bf16")
dsjax.save_checkpoint(params, cfg, quantised, layout="official", quantize=True)
dsjax.save_checkpoint(params, cfg, plain_dir, layout="official", quantize=False)

for path in (quantised, plain_dir):
    files = safetensors_io.open_dir(path)
    by_tag = {}
    for name, sf in files.items():
        n = int(np.prod(sf.shape(name)))
        tag = sf.dtype_name(name)
        size = n * np.dtype(safetensors_io.DTYPES[tag]).itemsize
        count, total = by_tag.get(tag, (0, 0))
        by_tag[tag] = (count + 1, total + size)
    on_disk = os.path.getsize(os.path.join(path, "model.safetensors"))
    print(f"{os.path.basename(path)}: {on_disk / 1e6:.2f} MB, "
          + ", ".join(f"{tag} {c} tensors {b / 1e6:.2f} MB" for tag, (c, b) in sorted(by_tag.items())))

model = dsjax.load(quantised)
same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), params, model.params)
n_equal, n_all = sum(jax.tree.leaves(same)), len(jax.tree.leaves(same))
print(f"loaded back ({model.source}): {n_equal} of {n_all} arrays bit-identical")
assert n_equal == n_all
shutil.rmtree(tmp)

# %% [markdown]
# Every array comes back bit for bit, so a model saved by dsjax and loaded again computes the same logits. The
# unquantised (bf16) file is larger by the factors of §3: dense weights 2x, FP4 experts 4x. The same
# `save_checkpoint` also writes transformers' `save_pretrained` layout (`layout="transformers"`, float32, no
# MTP), which the test suite loads into `DeepseekV4ForCausalLM` to check dsjax against code it did not write.
