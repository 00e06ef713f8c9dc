"""Official DeepSeek-V4 checkpoint layout <-> transformers 5.24 ``DeepseekV4ForCausalLM`` layout.

Plain Python + numpy (no torch, no jax) so that both the JAX venv and the oracle venv can import it by
path, and so a checkpoint can be converted without installing either framework.

Why this exists: transformers' ``DeepseekV4ForCausalLM`` is our exactness oracle. Its checkpoint
conventions differ from the official (inference-style) names, and the official tiny goldens are FP8/FP4,
which the oracle cannot load on CPU. So we dequantise with numpy and rename.

Three layouts (verified against transformers 5.24 by ``tests/oracle/make_random_checkpoint.py`` and a
clean ``from_pretrained`` load report in ``tests/oracle/run_transformers.py``):

``official``   DeepSeek's inference names: ``embed.weight``, ``layers.L.attn.wq_a.weight`` + ``.scale``,
               ``layers.L.ffn.experts.E.w1.weight`` ..., ``mtp.0.*``, ``head.weight``.
``internal``   ``model.state_dict()`` names: ``model.layers.L.self_attn.q_a_proj.weight``; routed experts
               FUSED per layer: ``mlp.experts.gate_up_proj`` [E, 2*I, D] = concat(w1, w3) along dim 1
               (gate = w1 first, up = w3 second; no transpose, still [out, in]) and
               ``mlp.experts.down_proj`` [E, D, I] = stack(w2).
``saved``      what ``save_pretrained`` writes. transformers reverts its load-time renames on save, but
               only partially: official names under a ``model.`` prefix, experts unfused again, except
               ``model.embed_tokens.weight``, ``model.norm.weight``, ``model.hc_head.hc_{fn,base,scale}``,
               top-level ``head.weight``, and ``model.layers.L.attn.norm.weight`` for the attention's
               kv_norm (the reverse of the blanket ``.norm.`` -> ``.kv_norm.`` rename). It is NOT the
               official layout. ``from_pretrained`` accepts all three layouts (the conversion mapping in
               transformers/conversion_mapping.py "deepseek_v4" handles official and saved names;
               internal names pass through).

Tensors transformers does not have: every ``*.scale`` (weights must be dequantised first: transformers
holds plain float weights; its FP8 quantizer path needs a GPU) and every ``mtp.*`` tensor (transformers
implements no MTP; ``_keys_to_ignore_on_load_unexpected = [r"(^|\\.)mtp\\..*"]`` drops them silently,
without listing them as unexpected). Shapes are otherwise identical ([out, in] everywhere).

dtypes: the oracle loads with ``dtype=float32`` so every float tensor becomes fp32; ``tid2eid`` is an
int64 buffer (official file: I64). In a bf16 model, ``_keep_in_fp32_modules_strict`` keeps hc_*, sinks,
position_bias (ape), e_score_correction_bias and all weighted RMSNorms in fp32.
"""
from __future__ import annotations

import json
import os
import re
import struct

import numpy as np

# ----------------------------------------------------------------------------------------------------------
# name mapping
# ----------------------------------------------------------------------------------------------------------
# Per-layer suffix map: official suffix (after ``layers.L.``) -> internal suffix (after ``model.layers.L.``).
_LAYER_SUFFIX = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "hc_attn_fn": "attn_hc.fn",
    "hc_attn_base": "attn_hc.base",
    "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn",
    "hc_ffn_base": "ffn_hc.base",
    "hc_ffn_scale": "ffn_hc.scale",
    "attn.attn_sink": "self_attn.sinks",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    # main KV compressor (CSA and HCA layers)
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.compressor.wkv.weight": "self_attn.compressor.kv_proj.weight",
    "attn.compressor.wgate.weight": "self_attn.compressor.gate_proj.weight",
    "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
    # lightning indexer (CSA layers); transformers nests it INSIDE the compressor
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "attn.indexer.compressor.wkv.weight": "self_attn.compressor.indexer.kv_proj.weight",
    "attn.indexer.compressor.wgate.weight": "self_attn.compressor.indexer.gate_proj.weight",
    "attn.indexer.compressor.norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    # MoE
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",  # score layers only
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",  # hash layers only (int64 buffer)
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
}
_GLOBAL = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
# save_pretrained's (partial) reverse renaming of the globals
_GLOBAL_SAVED = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
_LAYER_SUFFIX_INV = {v: k for k, v in _LAYER_SUFFIX.items()}
_GLOBAL_INV = {v: k for k, v in _GLOBAL.items()}
_GLOBAL_SAVED_INV = {v: k for k, v in _GLOBAL_SAVED.items()}

_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$")
_INT_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_INT_EXPERTS_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
LAYOUTS = ("saved", "internal")


def is_dropped(name: str) -> bool:
    """Official tensors with no transformers counterpart: FP8/FP4 block scales and the MTP head."""
    return name.endswith(".scale") or name.startswith("mtp.")


def official_to_transformers(name: str, array, layout: str = "saved") -> list:
    """Map ONE official tensor (already dequantised) to ``[(name, array), ...]`` in ``layout``.

    Returns ``[]`` for dropped tensors (``*.scale``, ``mtp.*``). Routed experts: ``saved`` keeps one tensor
    per expert; ``internal`` fuses all experts of a layer into one tensor, which a per-tensor call cannot
    build, so this raises for expert tensors there: use :func:`official_state_to_transformers`.
    """
    assert layout in LAYOUTS, layout
    if is_dropped(name):
        return []
    if name in _GLOBAL:
        return [((_GLOBAL_SAVED if layout == "saved" else _GLOBAL)[name], array)]
    m = _EXPERT_RE.match(name)
    if m:
        if layout == "saved":
            return [("model." + name, array)]
        raise ValueError(f"{name}: routed experts are fused in the internal layout; "
                         "use official_state_to_transformers(..., layout='internal')")
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _LAYER_SUFFIX:
        L, suf = m.groups()
        if layout == "saved":
            # save_pretrained reverts everything except kv_norm, which comes back as ``attn.norm``
            return [(f"model.layers.{L}." + ("attn.norm.weight" if suf == "attn.kv_norm.weight" else suf), array)]
        return [(f"model.layers.{L}.{_LAYER_SUFFIX[suf]}", array)]
    raise KeyError(f"unknown official V4 tensor name: {name}")


def official_state_to_transformers(tensors: dict, layout: str = "saved") -> dict:
    """Whole-checkpoint version of :func:`official_to_transformers`; fuses experts for ``internal``."""
    out, experts = {}, {}
    for name, arr in tensors.items():
        m = _EXPERT_RE.match(name)
        if m and layout == "internal":
            experts.setdefault(int(m.group(1)), {})[(int(m.group(2)), m.group(3))] = arr
            continue
        for k, v in official_to_transformers(name, arr, layout):
            out[k] = v
    for L, ex in sorted(experts.items()):
        n = 1 + max(e for e, _ in ex)
        out[f"model.layers.{L}.mlp.experts.gate_up_proj"] = np.stack(
            [np.concatenate([ex[(e, "w1")], ex[(e, "w3")]], axis=0) for e in range(n)])
        out[f"model.layers.{L}.mlp.experts.down_proj"] = np.stack([ex[(e, "w2")] for e in range(n)])
    return out


def transformers_to_official(name: str, array, layout: str = "saved") -> list:
    """Inverse of :func:`official_to_transformers`; splits fused internal experts into per-expert tensors.

    Scales and MTP tensors cannot be recovered (they never existed on the transformers side).
    """
    assert layout in LAYOUTS, layout
    ginv = _GLOBAL_SAVED_INV if layout == "saved" else _GLOBAL_INV
    if name in ginv:
        return [(ginv[name], array)]
    if layout == "internal":
        m = _INT_EXPERTS_RE.match(name)
        if m:
            L, kind = m.groups()
            if kind == "down_proj":
                return [(f"layers.{L}.ffn.experts.{e}.w2.weight", array[e]) for e in range(array.shape[0])]
            inter = array.shape[1] // 2
            res = []
            for e in range(array.shape[0]):
                res.append((f"layers.{L}.ffn.experts.{e}.w1.weight", array[e, :inter]))
                res.append((f"layers.{L}.ffn.experts.{e}.w3.weight", array[e, inter:]))
            return res
        m = _INT_LAYER_RE.match(name)
        if m and m.group(2) in _LAYER_SUFFIX_INV:
            return [(f"layers.{m.group(1)}.{_LAYER_SUFFIX_INV[m.group(2)]}", array)]
    else:
        if name.startswith("model.layers."):
            off = name[len("model."):]
            off = re.sub(r"^(layers\.\d+)\.attn\.norm\.weight$", r"\1.attn.kv_norm.weight", off)
            if _EXPERT_RE.match(off) or (_LAYER_RE.match(off) and _LAYER_RE.match(off).group(2) in _LAYER_SUFFIX):
                return [(off, array)]
    raise KeyError(f"unknown transformers ({layout}) V4 tensor name: {name}")


# ----------------------------------------------------------------------------------------------------------
# dequantisation (numpy)
# ----------------------------------------------------------------------------------------------------------
def _e4m3_table() -> np.ndarray:
    """All 256 FP8 e4m3fn values (bias 7, no inf, 0x7f/0xff = NaN)."""
    b = np.arange(256)
    s, e, m = b >> 7, (b >> 3) & 0xF, b & 7
    v = np.where(e == 0, m / 8.0 * 2.0**-6, (1 + m / 8.0) * 2.0 ** (e - 7.0))
    v = np.where((e == 15) & (m == 7), np.nan, v)
    return np.where(s == 1, -v, v).astype(np.float32)


E4M3 = _e4m3_table()
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def e8m0_to_f32(s: np.ndarray) -> np.ndarray:
    """UE8M0 scale byte -> 2**(s-127) (255 = NaN)."""
    s = s.astype(np.int32)
    out = np.ldexp(np.float32(1), np.minimum(s, 254) - 127).astype(np.float32)
    return np.where(s == 255, np.float32(np.nan), out)


def dequant_fp8(w_u8: np.ndarray, scale_u8: np.ndarray, block=(128, 128)) -> np.ndarray:
    """FP8 e4m3 weight [out, in] x ue8m0 block scale [ceil(out/b0), ceil(in/b1)] -> fp32 (exact)."""
    w = E4M3[w_u8]
    s = e8m0_to_f32(scale_u8)
    s = np.repeat(np.repeat(s, block[0], 0), block[1], 1)[: w.shape[0], : w.shape[1]]
    return w * s


def dequant_fp4(w_i8: np.ndarray, scale_u8: np.ndarray, group: int = 32) -> np.ndarray:
    """Packed FP4 e2m1 [out, in/2] (low nibble = even element) x ue8m0 scale [out, in/group] -> fp32."""
    u = w_i8.view(np.uint8)
    codes = np.stack([u & 0xF, u >> 4], axis=-1).reshape(u.shape[0], -1)
    return E2M1[codes] * np.repeat(e8m0_to_f32(scale_u8), group, axis=1)


def dequantize_official(raw: dict, block=(128, 128), fp4_group: int = 32) -> dict:
    """``{name: (dtype_str, ndarray)}`` from :func:`read_safetensors` -> ``{name: fp32/int64 array}``.

    FP8 (F8_E4M3) and packed-FP4 (I8) weights are multiplied by their ``.scale`` partner; scales are then
    dropped. BF16/F32 become fp32; I64/I32 stay integer (tid2eid -> int64).
    """
    out = {}
    for name, (dt, a) in raw.items():
        if name.endswith(".scale") and name[: -len("scale")] + "weight" in raw:
            continue
        sname = name[: -len("weight")] + "scale" if name.endswith(".weight") else None
        if dt == "F8_E4M3":
            out[name] = dequant_fp8(a, raw[sname][1], block)
        elif dt == "I8" and sname in raw:
            out[name] = dequant_fp4(a, raw[sname][1], fp4_group)
        elif dt in ("I64", "I32"):
            out[name] = a.astype(np.int64)
        else:
            out[name] = a.astype(np.float32)
    return out


# ----------------------------------------------------------------------------------------------------------
# minimal safetensors I/O (no torch / ml_dtypes needed: FP8/BF16 are read as raw integers)
# ----------------------------------------------------------------------------------------------------------
_ST_NP = {"F32": np.float32, "F64": np.float64, "F16": np.float16, "BF16": np.uint16, "I64": np.int64,
          "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
          "F8_E4M3": np.uint8, "F8_E5M2": np.uint8, "F8_E8M0": np.uint8}
_NP_ST = {np.dtype(np.float32): "F32", np.dtype(np.int64): "I64", np.dtype(np.int32): "I32",
          np.dtype(np.float16): "F16", np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8"}


def read_safetensors(path: str) -> dict:
    """-> ``{name: (dtype_str, ndarray)}``; BF16 comes back as fp32, FP8 as raw uint8 bytes."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        arr = np.frombuffer(data[a:b], dtype=_ST_NP[meta["dtype"]]).reshape(meta["shape"])
        if meta["dtype"] == "BF16":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        out[name] = (meta["dtype"], arr)
    return out


def write_safetensors(path: str, tensors: dict, metadata: dict | None = None) -> None:
    """Write ``{name: ndarray}`` (fp32 / int64 / ...) as a safetensors file, names sorted."""
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        b = a.tobytes()
        header[name] = {"dtype": _NP_ST[a.dtype], "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    header["__metadata__"] = dict(metadata or {"format": "pt"})
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for b in blobs:
            f.write(b)


# ----------------------------------------------------------------------------------------------------------
# config
# ----------------------------------------------------------------------------------------------------------
CONFIG_NOTES = """\
Keys DeepseekV4Config (transformers 5.24) needs, and how official ones map:
- layer_types: one of sliding_attention / compressed_sparse_attention / heavily_compressed_attention per
  backbone layer. The legacy `compress_ratios` list is accepted ONLY with values {0, 4, 128} (any other
  ratio raises KeyError in __post_init__), and is cut to num_hidden_layers (extra entries = MTP layers).
- compress_rates: {"compressed_sparse_attention": m, "heavily_compressed_attention": m'}: one CSA and one
  HCA ratio for the whole model. transformers' CSA is ALWAYS overlapped (2 x m window) with an indexer;
  the official code overlaps/indexes iff ratio == 4, so only CSA ratio 4 is expressible.
- mlp_layer_types: hash_moe / moe per layer (legacy num_hash_layers = first n layers hash_moe;
  default 3 when absent!).
- rope_parameters: {"main": {rope_type: default, rope_theta, partial_rotary_factor},
  "compress": {rope_type: yarn, rope_theta: compress_rope_theta, factor, original_max_position_embeddings,
  beta_fast, beta_slow, attention_factor: 1.0, partial_rotary_factor}}. A legacy top-level `rope_scaling`
  {type: yarn, ...} + rope_theta + compress_rope_theta is folded into this by __post_init__
  (attention_factor forced to 1.0 = no YaRN mscale, like the reference).
- partial_rotary_factor = qk_rope_head_dim / head_dim (qk_rope_head_dim is also accepted).
- sliding_window (= window_size), index_n_heads, index_head_dim, index_topk, o_groups, o_lora_rank,
  q_lora_rank, head_dim, hc_mult, hc_sinkhorn_iters, hc_eps, swiglu_limit, routed_scaling_factor,
  scoring_func (sqrtsoftplus), rms_norm_eps, num_experts_per_tok, n_routed_experts,
  moe_intermediate_size (also the SHARED expert width), vocab_size, hidden_size, num_attention_heads.
- n_shared_experts, norm_topk_prob, topk_method, num_nextn_predict_layers are stored but unused
  (the router always normalises; exactly one shared expert; no MTP).
- quantization_config must be dropped for dequantised fp32 weights (see run_transformers.py notes).
"""

_INFER_KEYS = {  # official inference/config.json (ModelArgs) -> HF name
    "dim": "hidden_size", "moe_inter_dim": "moe_intermediate_size", "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads", "n_activated_experts": "num_experts_per_tok",
    "score_func": "scoring_func", "route_scale": "routed_scaling_factor", "norm_eps": "rms_norm_eps",
    "window_size": "sliding_window", "rope_head_dim": "qk_rope_head_dim", "n_hash_layers": "num_hash_layers",
    "n_mtp_layers": "num_nextn_predict_layers",
}
_PASS = ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "head_dim", "q_lora_rank", "num_experts_per_tok", "n_routed_experts",
         "n_shared_experts", "scoring_func", "norm_topk_prob", "routed_scaling_factor", "max_position_embeddings",
         "rope_theta", "compress_rope_theta", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "swiglu_limit",
         "sliding_window", "o_groups", "o_lora_rank", "index_n_heads", "index_head_dim", "index_topk",
         "num_nextn_predict_layers", "hidden_act", "rms_norm_eps", "bos_token_id", "eos_token_id",
         "tie_word_embeddings", "attention_bias", "attention_dropout", "initializer_range", "topk_method")


def hf_config_from_official(cfg: dict, keep_quantization_config: bool = False, dtype: str = "float32") -> dict:
    """Official config (HF-style config.json with ``compress_ratios`` or inference ``ModelArgs`` json) ->
    a config.json dict ``DeepseekV4Config(**d)`` accepts, with explicit layer_types / compress_rates /
    mlp_layer_types / rope_parameters. An already-transformers config (``layer_types``) passes through
    (minus quantization_config unless kept)."""
    cfg = dict(cfg)
    for k, v in _INFER_KEYS.items():
        if k in cfg and v not in cfg:
            cfg[v] = cfg.pop(k)
    if "layer_types" in cfg:
        out = dict(cfg)
        if not keep_quantization_config:
            out.pop("quantization_config", None)
            out.pop("expert_dtype", None)
        out["dtype"] = dtype
        out.pop("torch_dtype", None)
        return out
    n = cfg["num_hidden_layers"]
    ratios = list(cfg["compress_ratios"])[:n]
    csa = sorted({r for r in ratios if r == 4})
    hca = sorted({r for r in ratios if r not in (0, 4)})
    if len(hca) > 1:
        raise ValueError(f"transformers supports one HCA ratio per model, got {hca}")
    layer_types = ["sliding_attention" if r == 0 else "compressed_sparse_attention" if r == 4
                   else "heavily_compressed_attention" for r in ratios]
    out = {k: cfg[k] for k in _PASS if k in cfg}
    out.update(architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", num_key_value_heads=1,
               layer_types=layer_types,
               compress_rates={"compressed_sparse_attention": csa[0] if csa else 4,
                               "heavily_compressed_attention": hca[0] if hca else 128},
               mlp_layer_types=["hash_moe" if i < cfg.get("num_hash_layers", 0) else "moe" for i in range(n)],
               dtype=dtype)
    rope_dim = cfg.get("qk_rope_head_dim", 64)
    prf = rope_dim / cfg["head_dim"]
    out["partial_rotary_factor"] = prf
    out["qk_rope_head_dim"] = rope_dim
    rs = cfg.get("rope_scaling")
    if rs is None and cfg.get("original_seq_len", 0) > 0:  # inference ModelArgs
        rs = {"type": "yarn", "factor": cfg["rope_factor"], "original_max_position_embeddings": cfg["original_seq_len"],
              "beta_fast": cfg.get("beta_fast", 32), "beta_slow": cfg.get("beta_slow", 1)}
    compress = {"rope_type": "default", "rope_theta": cfg.get("compress_rope_theta", 160000.0),
                "partial_rotary_factor": prf}
    if rs:
        compress.update(rope_type="yarn", factor=rs["factor"],
                        original_max_position_embeddings=rs["original_max_position_embeddings"],
                        beta_fast=rs.get("beta_fast", 32), beta_slow=rs.get("beta_slow", 1), attention_factor=1.0)
    out["rope_parameters"] = {
        "main": {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 10000.0), "partial_rotary_factor": prf},
        "compress": compress}
    out.setdefault("max_position_embeddings", cfg.get("max_seq_len", 4096))
    out.setdefault("use_cache", True)
    if keep_quantization_config and "quantization_config" in cfg:
        out["quantization_config"] = cfg["quantization_config"]
    return out


def convert_official_dir(src: str, dst: str, layout: str = "saved") -> dict:
    """Official dir (config.json [+ inference/config.json] + model.safetensors, FP8/FP4) -> transformers
    dir (config.json + fp32 model.safetensors in ``layout``). Returns the converted tensors."""
    cfg = json.load(open(os.path.join(src, "config.json")))
    q = cfg.get("quantization_config") or {}
    block = tuple(q.get("weight_block_size", (128, 128)))
    raw = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            raw.update(read_safetensors(os.path.join(src, f)))
    tensors = official_state_to_transformers(dequantize_official(raw, block), layout)
    os.makedirs(dst, exist_ok=True)
    write_safetensors(os.path.join(dst, "model.safetensors"), tensors)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(hf_config_from_official(cfg), f, indent=2, sort_keys=True)
    return tensors


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="convert an official V4 checkpoint dir to transformers layout")
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--layout", choices=LAYOUTS, default="saved")
    a = ap.parse_args()
    t = convert_official_dir(a.src, a.dst, a.layout)
    print(f"wrote {len(t)} tensors to {a.dst}")
