"""ModelConfig: presets against the model spec (§2), the layer schedule, hashing under jit, the three config.json
spellings (Hub, DeepSeek's inference/config.json, transformers' save_pretrained), numerics presets, weight bytes.

Expected values are typed in from /work/shared/reference/model-spec-v4-v41.md §2.1-2.2 and §5, not read back
from dsjax, so a wrong preset or a wrong key mapping fails here.
"""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import pytest

import dsjax
from dsjax import weights
from dsjax.config import NUMERICS, ModelConfig, config_from_dict, load_config
from dsjax.errors import ConfigError

DATA = os.path.join(os.path.dirname(__file__), "data")
CONFIGS = os.path.join(DATA, "configs")
V4_GOLDEN = os.path.join(DATA, "goldens", "v4_tiny_s1234")

V4_FLASH_RATIOS = (0, 0) + (4, 128) * 20 + (4,) + (0,)
V41_FLASH_RATIOS = (0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0)


def fields_except(cfg: ModelConfig, *skip: str) -> dict:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in skip}


def assert_same_fields(a: ModelConfig, b: ModelConfig, *skip: str):
    fa, fb = fields_except(a, *skip), fields_except(b, *skip)
    diff = {k: (fa[k], fb[k]) for k in fa if fa[k] != fb[k]}
    assert not diff, f"fields differ (got, expected): {diff}"


# ---------------------------------------------------------------------- presets vs the spec
V4_FLASH_SPEC = dict(
    family="v4", vocab_size=129280, dim=4096, n_layers=43, n_heads=64, head_dim=512, rope_head_dim=64,
    q_lora_rank=1024, o_groups=8, o_lora_rank=1024, n_routed_experts=256, n_shared_experts=1,
    n_activated_experts=6, moe_inter_dim=2048, n_hash_layers=3, score_func="sqrtsoftplus", route_scale=1.5,
    swiglu_limit=10.0, norm_eps=1e-6, rope_theta=10000.0, compress_rope_theta=160000.0, rope_factor=16.0,
    original_seq_len=65536, beta_fast=32, beta_slow=1, max_position_embeddings=1048576, window_size=128,
    compress_ratios=V4_FLASH_RATIOS, index_n_heads=64, index_head_dim=128, index_topk=512, hc_mult=4,
    hc_sinkhorn_iters=20, hc_eps=1e-6, n_mtp_layers=1, weight_dtype="fp8", expert_dtype="fp4",
    weight_block_size=128, bos_token_id=0, eos_token_id=1,
)

V41_FLASH_SPEC = dict(
    family="v4.1", vocab_size=129280, dim=5120, n_layers=40, n_heads=64, head_dim=512, rope_head_dim=64,
    q_lora_rank=1280, o_groups=8, o_lora_rank=1024, n_routed_experts=384, n_shared_experts=1,
    n_activated_experts=6, moe_inter_dim=2304, n_hash_layers=0, score_func="sqrtsoftplus", route_scale=1.5,
    swiglu_limit=10.0, norm_eps=1e-20, rope_theta=10000.0, compress_rope_theta=160000.0, rope_factor=16.0,
    original_seq_len=65536, beta_fast=32, beta_slow=1, max_position_embeddings=1048576, window_size=128,
    compress_ratios=V41_FLASH_RATIOS, index_n_heads=32, index_head_dim=128, index_topk=512, hc_mult=4,
    hc_sinkhorn_iters=20, hc_eps=1e-6, n_mtp_layers=3, weight_dtype="fp8", expert_dtype="fp4",
    weight_block_size=32, kv_source_layers=(2, 8, 14, 20), index_source_layers=(2, 8, 14, 20, 24, 28, 32, 36),
    candidate_source_layer=20, candidate_topk_blocks=2048, candidate_block_size=8, engram_layer_ids=(1, 14),
    engram_num_embeddings=(384006168, 384016682), engram_max_ngram_size=4, engram_vocab_size=16000000,
    engram_n_heads=8, engram_head_dim=256, engram_pad_id=2, engram_compressed_vocab_size=99092,
    dspark_block_size=5, dspark_noise_token_id=128799, dspark_target_layer_ids=(37, 38, 39),
    dspark_markov_rank=256, dspark_n_routed_experts=128, dspark_n_activated_experts=3, vision_n_layers=32,
    bos_token_id=0, eos_token_id=1, pad_token_id=2,
)


@pytest.mark.parametrize("name,spec", [("v4-flash", V4_FLASH_SPEC), ("v4-flash-0731", V4_FLASH_SPEC),
                                       ("v4.1-flash", V41_FLASH_SPEC)])
def test_preset_values_match_spec(name, spec):
    cfg = dsjax.preset(name)
    assert cfg.name == name
    got = {k: getattr(cfg, k) for k in spec}
    assert got == spec, {k: (got[k], spec[k]) for k in spec if got[k] != spec[k]}


def test_compress_ratio_lengths():
    """44 entries for V4-Flash (43 layers + MTP), 43 for V4.1-Flash (40 layers + 3 DSpark stages)."""
    assert len(dsjax.preset("v4-flash").compress_ratios) == 44 == dsjax.preset("v4-flash").n_total_layers
    assert len(dsjax.preset("v4.1-flash").compress_ratios) == 43 == dsjax.preset("v4.1-flash").n_total_layers


def test_0731_keeps_the_v4_backbone():
    assert_same_fields(dsjax.preset("v4-flash-0731"), dsjax.preset("v4-flash"), "name")


def test_preset_overrides_and_unknown_fields():
    cfg = dsjax.preset("tiny-v4", vocab_size=1024)
    assert cfg.vocab_size == 1024 and cfg.dim == 128
    with pytest.raises(TypeError):
        dsjax.preset("tiny-v4", no_such_field=1)


def test_tiny_v4_covers_every_v4_feature():
    """The CPU test model has window, CSA and HCA layers, hash and score routing, an MTP layer and FP8/FP4."""
    cfg = dsjax.preset("tiny-v4")
    assert cfg.family == "v4" and cfg.compress_ratios == (0, 4, 16, 4, 16, 4, 0)
    assert [cfg.layer_kind(i) for i in range(cfg.n_total_layers)] == \
        ["window", "csa", "hca", "csa", "hca", "csa", "window"]
    assert [cfg.layer_uses_hash_routing(i) for i in range(cfg.n_layers)] == [True, True] + [False] * 4
    assert cfg.n_mtp_layers == 1 and cfg.weight_dtype == "fp8" and cfg.expert_dtype == "fp4"
    assert cfg.vocab_size == 129280  # the real tokenizer's ids fit


# ---------------------------------------------------------------------- layer schedule (§2.2)
def test_v4_flash_layer_schedule():
    cfg = dsjax.preset("v4-flash")
    kinds = [cfg.layer_kind(i) for i in range(cfg.n_total_layers)]
    assert kinds[:2] == ["window", "window"]
    assert [i for i, k in enumerate(kinds) if k == "csa"] == list(range(2, 43, 2))   # 21 CSA layers
    assert [i for i, k in enumerate(kinds) if k == "hca"] == list(range(3, 42, 2))   # 20 HCA layers
    assert kinds[43] == "window"                                                       # the MTP layer
    assert [cfg.layer_ratio(i) for i in range(2, 43, 2)] == [4] * 21
    assert [cfg.layer_ratio(i) for i in range(3, 42, 2)] == [128] * 20
    assert [i for i in range(cfg.n_total_layers) if cfg.layer_uses_hash_routing(i)] == [0, 1, 2]
    # rope: window-only layers use theta 10000 without YaRN; compressed layers 160000 with YaRN
    assert cfg.layer_rope(0) == (10000.0, False) and cfg.layer_rope(43) == (10000.0, False)
    assert cfg.layer_rope(2) == (160000.0, True) and cfg.layer_rope(3) == (160000.0, True)


def test_v41_flash_layer_schedule():
    cfg = dsjax.preset("v4.1-flash")
    kinds = [cfg.layer_kind(i) for i in range(cfg.n_total_layers)]
    assert kinds == ["window"] * 2 + ["csa2"] * 38 + ["window"] * 3
    assert not any(cfg.layer_uses_hash_routing(i) for i in range(cfg.n_total_layers))
    assert cfg.kv_quant_block == 32 and dsjax.preset("v4-flash").kv_quant_block == 64


# ---------------------------------------------------------------------- hashing / jit
def test_config_is_hashable_and_a_jit_static_arg():
    a, b = dsjax.preset("tiny-v4"), dsjax.preset("tiny-v4")
    assert a is not b and a == b and hash(a) == hash(b)
    assert len({a, b, a.replace(window_size=16)}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.dim = 3  # type: ignore[misc]
    traces = []

    def f(x, cfg):
        traces.append(cfg)
        return x * cfg.window_size

    g = jax.jit(f, static_argnames="cfg")
    x = jnp.ones(3)
    assert float(g(x, cfg=a)[0]) == 32.0
    assert float(g(x, cfg=b)[0]) == 32.0          # equal config: cache hit, no retrace
    assert len(traces) == 1
    assert float(g(x, cfg=a.replace(window_size=16))[0]) == 16.0
    assert len(traces) == 2


# ---------------------------------------------------------------------- config.json spellings
def test_released_v4_flash_config_json_reads_as_the_preset():
    """The released V4-Flash config.json (initial revision: no root expert_dtype, FP4 experts nonetheless)."""
    cfg = load_config(os.path.join(CONFIGS, "deepseek-v4-flash.config.json"), name="v4-flash")
    assert_same_fields(cfg, dsjax.preset("v4-flash"))


def test_current_revision_v4_flash_config_json_reads_as_the_preset():
    """The current HF revision adds `"expert_dtype": "fp4"` at the root (spec §1, S3)."""
    with open(os.path.join(CONFIGS, "deepseek-v4-flash.config.json")) as f:
        raw = json.load(f)
    raw["expert_dtype"] = "fp4"
    assert_same_fields(config_from_dict(raw, name="v4-flash"), dsjax.preset("v4-flash"))


def test_golden_hub_and_inference_configs_agree():
    """The V4 golden's HF config.json and DeepSeek's inference/config.json (short names) give one model.

    max_position_embeddings is the one field the inference file does not carry (it has the runtime cap
    max_seq_len instead), so it keeps the default there."""
    hub = load_config(V4_GOLDEN)
    inference = load_config(os.path.join(V4_GOLDEN, "inference", "config.json"))
    assert hub.name == "v4_tiny_s1234"
    assert_same_fields(hub, inference, "name", "max_position_embeddings")
    assert hub.max_position_embeddings == 384
    assert (hub.vocab_size, hub.dim, hub.n_layers, hub.compress_ratios, hub.n_hash_layers) == \
        (512, 128, 6, (0, 4, 16, 4, 16, 4, 0), 2)
    assert (hub.weight_dtype, hub.expert_dtype, hub.weight_block_size) == ("fp8", "fp4", 128)
    bf16 = load_config(os.path.join(V4_GOLDEN, "inference", "config_bf16.json"))
    assert (bf16.weight_dtype, bf16.expert_dtype) == ("bf16", "bf16")
    assert_same_fields(bf16, inference, "name", "weight_dtype", "expert_dtype")


def test_v41_nested_text_config():
    hub = load_config(os.path.join(CONFIGS, "v41_tiny_s4321.config.json"), name="v41")
    inference = load_config(os.path.join(CONFIGS, "v41_tiny_s4321.inference.json"), name="v41")
    assert hub.family == "v4.1" and inference.family == "v4.1"
    assert_same_fields(hub, inference, "max_position_embeddings")
    assert (hub.dim, hub.n_layers, hub.n_mtp_layers, hub.norm_eps, hub.weight_block_size) == (64, 10, 3, 1e-20, 32)
    assert hub.kv_source_layers == (2, 4, 6) and hub.index_source_layers == (2, 4, 6, 8)
    assert (hub.candidate_source_layer, hub.candidate_topk_blocks, hub.candidate_block_size) == (6, 3, 4)
    assert hub.engram_layer_ids == (1, 4) and hub.engram_num_embeddings == (630, 834)
    assert (hub.engram_pad_id, hub.dspark_n_activated_experts, hub.pad_token_id) == (2, 2, 2)
    assert (hub.weight_dtype, hub.expert_dtype, hub.n_hash_layers) == ("fp8", "fp4", 0)
    assert [hub.layer_kind(i) for i in range(hub.n_total_layers)] == ["window"] * 2 + ["csa2"] * 8 + ["window"] * 3


def _distinctive_tiny() -> ModelConfig:
    """tiny-v4 with every round-tripped scalar moved off its default, so a dropped key cannot pass unnoticed."""
    return dsjax.preset(
        "tiny-v4", vocab_size=640, n_layers=3, compress_ratios=(0, 4, 8, 0), n_hash_layers=1,
        n_activated_experts=3, route_scale=2.5, swiglu_limit=7.0, norm_eps=1e-5, rope_theta=5000.0,
        compress_rope_theta=80000.0, rope_factor=8.0, original_seq_len=4096, beta_fast=16, beta_slow=2,
        max_position_embeddings=2048, window_size=16, index_topk=4, hc_sinkhorn_iters=10, hc_eps=1e-5,
        bos_token_id=3, eos_token_id=5, pad_token_id=5)


def _write_checkpoint(cfg, path, **kw):
    from dsjax.params import init_params
    dsjax.save_checkpoint(init_params(cfg, 0), cfg, path, **kw)


def test_official_layout_config_round_trips(tmp_path):
    cfg = _distinctive_tiny()
    path = tmp_path / "tiny"
    _write_checkpoint(cfg, str(path))
    assert_same_fields(load_config(str(path)), cfg, "name")
    bf16 = tmp_path / "tiny-bf16"
    _write_checkpoint(cfg, str(bf16), quantize=False)
    assert_same_fields(load_config(str(bf16)), cfg.replace(weight_dtype="bf16", expert_dtype="bf16"), "name")


@pytest.mark.parametrize("name", ["v4-flash", "tiny-v4"])
def test_hub_config_dict_round_trips_presets(name):
    cfg = dsjax.preset(name)
    from dsjax.checkpoint import hf_config_dict
    assert config_from_dict(hf_config_dict(cfg, quantized=True), name=name) == cfg


def test_transformers_layout_config_round_trips(tmp_path):
    """transformers' save_pretrained spelling (layer_types, compress_rates, mlp_layer_types, rope_parameters).

    The layout has no MTP weights: load_config keeps what config.json declares (num_nextn_predict_layers),
    checkpoint_config drops the MTP layer the directory cannot hold. Weights are float32 there, so bf16."""
    from dsjax.checkpoint import checkpoint_config
    cfg = _distinctive_tiny()
    path = tmp_path / "tiny"
    _write_checkpoint(cfg, str(path), layout="transformers")
    with open(path / "config.json") as f:
        raw = json.load(f)
    assert "layer_types" in raw and "compress_ratios" not in raw  # really the transformers spelling
    plain = cfg.replace(weight_dtype="bf16", expert_dtype="bf16")
    assert_same_fields(load_config(str(path)), plain, "name")
    held = checkpoint_config(str(path))
    assert_same_fields(held, plain.replace(n_mtp_layers=0, compress_ratios=cfg.compress_ratios[:cfg.n_layers]), "name")


# ---------------------------------------------------------------------- numerics presets
NUMERIC_FIELDS = {
    "transformers": dict(compute_dtype="float32", kv_quant_sim=False, index_quant_sim=False, act_quant_sim=False),
    "reference-bf16": dict(compute_dtype="bfloat16", kv_quant_sim=True, index_quant_sim=True, act_quant_sim=False),
    "reference-fp8": dict(compute_dtype="bfloat16", kv_quant_sim=True, index_quant_sim=True, act_quant_sim=True),
}
if "batch_invariant" in {f.name for f in dataclasses.fields(ModelConfig)}:
    # token-by-token compute, so chunked prefill and decode match a full forward bit for bit (transformers only)
    for _name, _fields in NUMERIC_FIELDS.items():
        _fields["batch_invariant"] = _name == "transformers"


@pytest.mark.parametrize("numerics", NUMERICS)
def test_with_numerics_sets_its_fields(numerics):
    base = dsjax.preset("tiny-v4").replace(compute_dtype="float32", kv_quant_sim=False, act_quant_sim=True)
    cfg = base.with_numerics(numerics)
    assert {k: getattr(cfg, k) for k in NUMERIC_FIELDS[numerics]} == NUMERIC_FIELDS[numerics]
    assert cfg.numerics == numerics
    assert_same_fields(cfg, base, *NUMERIC_FIELDS[numerics])  # nothing else moves


def test_default_numerics_and_custom():
    assert dsjax.preset("v4-flash").numerics == "reference-bf16"
    assert dsjax.preset("tiny-v4").replace(kv_quant_sim=False).numerics == "custom"


# ---------------------------------------------------------------------- weight bytes
def _spec_v4_flash_checkpoint_bytes() -> tuple[int, int, int]:
    """Bytes of the released V4-Flash checkpoint from the spec's tensor inventory (§5.2), independently of
    dsjax.weights: (total, bytes of every attn.wo_a as stored FP8 + scales, bytes of the I64 tid2eid tables)."""
    V, D, H, d, q, G, R, E, I, k = 129280, 4096, 64, 512, 1024, 8, 1024, 256, 2048, 6

    def fp8(o, i):  # e4m3 weight + one E8M0 byte per 128x128 block
        return o * i + -(-o // 128) * -(-i // 128)

    def fp4(o, i):  # two codes per byte + one E8M0 byte per 32 inputs
        return o * i // 2 + o * (i // 32)

    wo_a = fp8(G * R, H * d // G)
    tid2eid = V * k * 8

    def layer(ratio, hashed):
        b = 4 * H + fp8(q, D) + 2 * q + fp8(H * d, q) + fp8(d, D) + 2 * d + wo_a + fp8(D, G * R) + 2 * 2 * D
        b += 2 * (4 * 24 * 4 * D + 4 * 24 + 4 * 3)                       # hc_attn_*, hc_ffn_*
        b += 2 * E * D + (tid2eid if hashed else 4 * E)                    # gate + tid2eid | bias
        b += E * (2 * fp4(I, D) + fp4(D, I)) + 2 * fp8(I, D) + fp8(D, I)   # routed + shared experts
        if ratio == 4:
            b += 4 * 4 * 1024 + 2 * 2 * 1024 * D + 2 * 512                 # compressor (overlapping: 2x width)
            b += fp8(8192, 1024) + 2 * 64 * D + 4 * 4 * 256 + 2 * 2 * 256 * D + 2 * 128  # indexer
        elif ratio == 128:
            b += 4 * 128 * 512 + 2 * 2 * 512 * D + 2 * 512
        return b

    hc_head = 4 * 4 * 4 * D + 4 * 4 + 4
    total = 2 * 2 * V * D + 2 * D + hc_head
    total += sum(layer(r, i < 3) for i, r in enumerate(V4_FLASH_RATIOS[:43]))
    total += layer(0, False) + 2 * fp8(D, D) + 3 * 2 * D + hc_head      # mtp.0 (embed/head shared)
    return total, 44 * wo_a, 3 * tid2eid


def test_v4_flash_weight_bytes():
    """The spec counts 159.6 GB for the V4-Flash checkpoint incl. MTP; our enumeration of §5.2 gives exactly that.

    dsjax keeps the checkpoint formats except two documented ones: attn.wo_a is dequantised to bf16 at load
    (as convert.py does: 2 bytes instead of 1 + scales, 44 layers) and tid2eid is int32 instead of int64. With
    those two terms the byte count must match exactly; without them it is within 1% of 159.6 GB (+0.92%)."""
    total, wo_a_fp8, tid2eid_i64 = _spec_v4_flash_checkpoint_bytes()
    assert round(total / 1e9, 1) == 159.6
    G, R, H, d = 8, 1024, 64, 512
    expected = total - wo_a_fp8 + 44 * 2 * (G * R) * (H * d // G) - tid2eid_i64 // 2
    cfg = dsjax.preset("v4-flash")
    assert weights.nbytes(cfg) == expected
    assert abs(weights.nbytes(cfg) / 159.6e9 - 1) < 0.01
    assert weights.nbytes(dsjax.preset("v4-flash-0731")) == expected


def test_tiny_weight_bytes_match_init():
    from dsjax.params import init_params
    cfg = dsjax.preset("tiny-v4", vocab_size=256, n_layers=2, compress_ratios=(0, 4, 0), n_hash_layers=1)
    leaves = jax.tree.leaves(init_params(cfg, 0))
    assert weights.nbytes(cfg) == sum(x.nbytes for x in leaves)
    assert jax.tree.structure(weights.abstract(cfg)) == jax.tree.structure(init_params(cfg, 0))


def test_describe_v41_is_its_own_tree():
    """V4.1's weight tree (v41_weights.describe41): no hc_head, CSA2 roles, Engram, DSpark under mtp."""
    from dsjax.v41_weights import Model41
    cfg = dsjax.preset("v4.1-flash")
    tree = weights.describe(cfg)
    assert isinstance(tree, Model41) and tree.hc_head is None
    assert weights.nbytes(cfg) > 500e9

def test_v41_roles_are_validated():
    """CSA2 layers read the latest KV and index source of their own ratio (spec §2.2); errors name the layer."""
    with pytest.raises(ConfigError, match=r"layer 20 \(ratio 1\) reads the latest of kv_source_layers .* found 14"):
        dsjax.preset("v4.1-flash", kv_source_layers=(2, 8, 14))
    with pytest.raises(ConfigError, match="KV source layer 9 must compress"):
        dsjax.preset("v4.1-flash", kv_source_layers=(2, 9, 14, 20))
    with pytest.raises(ConfigError, match="engram_num_embeddings needs one table size per Engram layer"):
        dsjax.preset("v4.1-flash", engram_num_embeddings=(384006168,))
    assert dsjax.preset("v4.1-flash").reference_index_key_bug is False


def test_tiny_v41_preset_random_weights(test_seed):
    """tiny-v41 (the golden case's shapes, real vocabulary): random weights in checkpoint formats match the
    description leaf for leaf; Engram scales start at e8m0 byte 127 (x1), so the tables are not silenced."""
    from dsjax.params import init_params
    cfg = dsjax.preset("tiny-v41")
    params = init_params(cfg, test_seed)
    assert jax.tree.structure(weights.abstract(cfg)) == jax.tree.structure(params)
    assert weights.nbytes(cfg) == sum(x.nbytes for x in jax.tree.leaves(params))
    assert int(params.layers[1].engram.embed.scale.min()) == 127 and params.layers[4].engram is not None
