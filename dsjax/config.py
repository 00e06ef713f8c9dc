"""ModelConfig: every shape and switch of a DeepSeek-V4-family model, frozen and hashable.

The config is static under `jax.jit` (it is hashed into the compile cache), so every shape in the model code
comes from here: window size, rope dims, head dims, compress ratios. It reads the three spellings seen in the
wild — the Hub `config.json` (HF names, V4.1 nested `text_config`), DeepSeek's `inference/config.json` (short
names) and transformers 5.24's `save_pretrained` (`layer_types` + `compress_rates`, `mlp_layer_types`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Literal

from dsjax.errors import ConfigError
from dsjax.sharding import ShardingRules

Family = Literal["v4", "v4.1"]
LayerKind = Literal["window", "csa", "hca", "csa2"]

NUMERICS = ("transformers", "reference-bf16", "reference-fp8")
KERNELS = ("auto", "pallas", "xla", "reference")
# the ops with a Pallas kernel, which `kernels` can set one by one ("auto+chunk_attention=pallas")
KERNEL_OPS = ("chunk_attention", "sparse_mqa", "indexer_topk", "moe_gemm", "quant_linear", "mhc_sinkhorn")


def split_kernels(spec: str) -> tuple[str, dict[str, str]]:
    """`kernels` -> (mode, {op: "pallas" | "xla"}): a mode of KERNELS, then optional per-op overrides for
    ablations, "MODE[+OP=IMPL...]" (e.g. "auto+chunk_attention=pallas+moe_gemm=xla"). An override asks for the
    op's kernel or XLA whatever the mode picks; a kernel still needs its inputs to fit (bf16, unsharded...)."""
    mode, *rest = [part.strip() for part in str(spec).split("+")]
    if mode not in KERNELS:
        raise ConfigError(f"unknown kernels {mode!r}; choose one of {', '.join(KERNELS)}, optionally followed by "
                          f"per-op overrides like '+chunk_attention=pallas'")
    overrides: dict[str, str] = {}
    for part in rest:
        op, eq, impl = part.partition("=")
        if not eq or op not in KERNEL_OPS or impl not in ("pallas", "xla"):
            raise ConfigError(f"bad kernel override {part!r} in {spec!r}: write OP=pallas or OP=xla, OP one of "
                              f"{', '.join(KERNEL_OPS)}")
        overrides[op] = impl
    return mode, overrides


KERNELS_HELP = "op implementations: auto | xla | pallas, then optional per-op overrides (auto+chunk_attention=pallas)"


def kernels_arg(spec: str) -> str:
    """argparse `type` for a --kernels flag: the spec, checked by `split_kernels` (a usage error, not a trace)."""
    import argparse

    try:
        split_kernels(spec)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return spec


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture + numerics of one model. Field names follow DeepSeek's inference config."""

    name: str = "custom"
    family: Family = "v4"
    vocab_size: int = 129280
    dim: int = 4096
    n_layers: int = 43
    n_heads: int = 64
    head_dim: int = 512
    rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    # MoE
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    n_activated_experts: int = 6
    moe_inter_dim: int = 2048
    n_hash_layers: int = 3
    score_func: str = "sqrtsoftplus"
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    gate_temp: float = 1.0
    # norms / rope
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 16.0
    original_seq_len: int = 65536
    beta_fast: int = 32
    beta_slow: int = 1
    max_position_embeddings: int = 1048576
    # attention schedule (len = n_layers + n_mtp_layers)
    window_size: int = 128
    compress_ratios: tuple[int, ...] = (0, 0) + (4, 128) * 20 + (4, 0)
    # indexer
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    # hyper-connections
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # draft heads
    n_mtp_layers: int = 1
    # reduced vocabulary (V4 only): embed/head hold this many rows, row r standing for token id vocab_ids[r] (a
    # weight tensor), the last row for every unmapped id; logits still span vocab_size columns. 0: full vocabulary
    head_vocab_size: int = 0
    # checkpoint formats
    weight_dtype: Literal["fp8", "bf16"] = "fp8"
    expert_dtype: Literal["fp4", "fp8", "bf16"] = "fp4"
    weight_block_size: int = 128
    # V4.1 (CSA2, Engram, DSpark, vision); unused by V4
    kv_source_layers: tuple[int, ...] = ()
    index_source_layers: tuple[int, ...] = ()
    candidate_source_layer: int = -1
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 0
    engram_vocab_size: int = 0
    engram_n_heads: int = 0
    engram_head_dim: int = 0
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 0
    dspark_block_size: int = 0
    dspark_noise_token_id: int = -1
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 0
    dspark_n_routed_experts: int = 0
    dspark_n_activated_experts: int = 0
    # V4.1 vision (names as DeepSeek's inference ModelArgs; HF: vision_config); vision_n_layers 0 = no tower
    vision_n_layers: int = 0
    vision_dim: int = 1024
    vision_n_heads: int = 16
    vision_inter_dim: int = 2816
    vision_patch_size: int = 14
    vision_rope_theta: float = 10000.0
    vision_downsample_ratio: int = 3
    vision_max_n_token: int = 1024       # image-span positions, start/newlines/end included
    vision_min_pixels: int = 544 * 544   # smaller images are upscaled to about this many pixels
    vision_max_wh_ratio: int | None = None  # None in the V4.1 release: no width clamp
    image_token_id: int = 129264         # <｜deepseek_image｜>; every position of an image span carries it
    # V4.1 reference behaviour switch: the official decode path scores ratio-2 index sources against the last
    # *published* index keys (spec §1 item 3, a bug); False (default) reads each source's own owner's keys
    reference_index_key_bug: bool = False
    # special tokens
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 1
    # numerics: three independent switches + the activation dtype (see `with_numerics`)
    compute_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    kv_quant_sim: bool = True
    index_quant_sim: bool = True
    act_quant_sim: bool = False
    batch_invariant: bool = False  # compute token by token: results independent of chunking (see layers/rows.py)
    # kernel selection for every op (see pallas_kernels/)
    kernels: str = "auto"
    # V4.1 Reindex layers: score every key and mask the non-candidates ("all"), or score only the candidate
    # positions ("candidates", layers/reindex.py: the same picks; fewer keys from ~130k context on). Execution only.
    reindex_scope: Literal["all", "candidates"] = "all"
    # logical -> mesh axes (sharding.py); inert without a mesh. Deployment, not architecture: never serialised.
    sharding: ShardingRules = ShardingRules()

    def to_dict(self) -> dict[str, Any]:
        """The architecture and numerics as plain JSON values (no sharding rules)."""
        out = dataclasses.asdict(self)
        out.pop("sharding")
        return out

    def __post_init__(self):
        self.validate()

    # ------------------------------------------------------------------ derived schedule
    @property
    def n_total_layers(self) -> int:
        return self.n_layers + self.n_mtp_layers

    def layer_ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def layer_kind(self, layer: int) -> LayerKind:
        """window (SWA only), csa (ratio 4 + indexer), hca (other ratios, all entries), csa2 (V4.1)."""
        ratio = self.compress_ratios[layer]
        if ratio == 0:
            return "window"
        if self.family == "v4.1":
            return "csa2"
        return "csa" if ratio == 4 else "hca"

    def layer_uses_hash_routing(self, layer: int) -> bool:
        return self.family == "v4" and layer < self.n_hash_layers

    def layer_rope(self, layer: int) -> tuple[float, bool]:
        """(theta, yarn): compressed layers use compress_rope_theta with YaRN, window-only layers plain rope."""
        if self.compress_ratios[layer]:
            return self.compress_rope_theta, True
        return self.rope_theta, False

    @property
    def vision_enabled(self) -> bool:
        return self.family == "v4.1" and self.vision_n_layers > 0

    @property
    def scores_are_bf16(self) -> bool:
        """Indexer scores hold bf16 values (bf16 compute): the top-k may take the sort-free radix select."""
        return self.compute_dtype == "bfloat16"

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.rope_head_dim

    @property
    def act_quant_block(self) -> int:
        return self.weight_block_size

    @property
    def kv_quant_block(self) -> int:
        """V4 rounds the 448 non-rope dims in blocks of 64; V4.1 all 512 dims in blocks of 32."""
        return 64 if self.family == "v4" else 32

    @property
    def index_quant_block(self) -> int:
        """FP4 (e2m1, ue8m0 scale) block of the indexer's queries and keys."""
        return 32

    @property
    def numerics(self) -> str:
        for name in NUMERICS:
            if dataclasses.replace(self, **_NUMERIC_FIELDS[name]) == self:
                return name
        return "custom"

    @property
    def kernel_mode(self) -> str:
        """`kernels` without its per-op overrides."""
        return split_kernels(self.kernels)[0]

    def with_numerics(self, numerics: str) -> "ModelConfig":
        if numerics not in _NUMERIC_FIELDS:
            raise ConfigError(f"unknown numerics {numerics!r}; choose one of {', '.join(NUMERICS)}")
        return dataclasses.replace(self, **_NUMERIC_FIELDS[numerics])

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        def need(cond, msg):
            if not cond:
                raise ConfigError(f"{self.name}: {msg}")

        need(self.family in ("v4", "v4.1"), f"family must be 'v4' or 'v4.1', got {self.family!r}")
        need(self.reindex_scope in ("all", "candidates"),
             f"reindex_scope must be 'all' or 'candidates', got {self.reindex_scope!r}")
        for f in ("vocab_size", "dim", "n_layers", "n_heads", "head_dim", "q_lora_rank", "o_groups",
                  "o_lora_rank", "n_routed_experts", "n_activated_experts", "moe_inter_dim", "window_size",
                  "hc_mult", "hc_sinkhorn_iters"):
            need(isinstance(getattr(self, f), int) and getattr(self, f) > 0, f"{f} must be a positive int, got {getattr(self, f)!r}")
        need(len(self.compress_ratios) == self.n_layers + self.n_mtp_layers,
             f"compress_ratios has {len(self.compress_ratios)} entries, expected n_layers + n_mtp_layers = "
             f"{self.n_layers + self.n_mtp_layers}")
        need(0 < self.rope_head_dim <= self.head_dim and self.rope_head_dim % 2 == 0,
             f"rope_head_dim {self.rope_head_dim} must be even and ≤ head_dim {self.head_dim}")
        need(self.n_heads % self.o_groups == 0, f"n_heads {self.n_heads} must be divisible by o_groups {self.o_groups}")
        need(self.n_activated_experts <= self.n_routed_experts, "n_activated_experts > n_routed_experts")
        need(self.n_shared_experts in (0, 1), f"n_shared_experts must be 0 or 1, got {self.n_shared_experts}")
        need(self.score_func in ("sqrtsoftplus", "softmax", "sigmoid"), f"unknown score_func {self.score_func!r}")
        need(self.compute_dtype in ("bfloat16", "float32"), f"compute_dtype must be bfloat16 or float32, got {self.compute_dtype!r}")
        split_kernels(self.kernels)   # raises ConfigError naming the mode or the override at fault
        need(self.weight_dtype in ("fp8", "bf16"), f"weight_dtype must be fp8 or bf16, got {self.weight_dtype!r}")
        need(self.expert_dtype in ("fp4", "fp8", "bf16"), f"expert_dtype must be fp4, fp8 or bf16, got {self.expert_dtype!r}")
        need(self.head_vocab_size == 0 or (self.family == "v4" and 2 <= self.head_vocab_size <= self.vocab_size),
             f"head_vocab_size must be 0 (full vocabulary) or in [2, vocab_size] for a V4 model, got {self.head_vocab_size}")
        for r in self.compress_ratios:
            need(isinstance(r, int) and r >= 0, f"compress ratio {r!r} must be a non-negative int")
        if self.family == "v4":
            need(all(r == 0 for r in self.compress_ratios[self.n_layers:]), "V4 MTP layers must be window-only (ratio 0)")
            need(self.index_head_dim >= self.rope_head_dim, "index_head_dim must be ≥ rope_head_dim")
            need(self.n_hash_layers <= self.n_layers, "n_hash_layers > n_layers")
            if any(r == 4 for r in self.compress_ratios):
                need(self.index_topk > 0 and self.index_n_heads > 0, "CSA layers need index_topk and index_n_heads")
        if self.family == "v4.1":
            self._validate_v41(need)
        if self.expert_dtype == "fp4":
            need(self.dim % 32 == 0 and self.moe_inter_dim % 32 == 0, "FP4 experts need dim and moe_inter_dim divisible by 32")


    def _validate_v41(self, need) -> None:
        """CSA2 roles (spec §2.2): every compressed layer reads the latest KV source and index source at or before
        it, of its own ratio; KV sources own index keys, so they are index sources too."""
        ratios, L = self.compress_ratios, self.n_layers
        for name in ("kv_source_layers", "index_source_layers", "engram_layer_ids"):
            ids = getattr(self, name)
            need(list(ids) == sorted(set(ids)) and all(0 <= i < L for i in ids),
                 f"{name} {ids} must be distinct backbone layers in increasing order")
        need(all(r == 0 for r in ratios[L:]), "V4.1 DSpark layers must be window-only (ratio 0)")
        for s in self.kv_source_layers:
            need(ratios[s] > 0 and s in self.index_source_layers,
                 f"KV source layer {s} must compress (ratio > 0) and own an indexer (be an index source)")
        for layer in range(L):
            if not ratios[layer]:
                continue
            for name in ("kv_source_layers", "index_source_layers"):
                src = [s for s in getattr(self, name) if s <= layer]
                need(src and ratios[src[-1]] == ratios[layer],
                     f"layer {layer} (ratio {ratios[layer]}) reads the latest of {name} at or before it, which must "
                     f"have the same ratio; found {src[-1] if src else 'none'}")
        if self.candidate_source_layer >= 0:
            need(self.candidate_source_layer in self.index_source_layers and self.candidate_topk_blocks > 0
                 and self.candidate_block_size > 0,
                 "candidate_source_layer must be an index source, with candidate_topk_blocks and _block_size > 0")
        need(self.head_dim % 32 == 0 and self.index_head_dim % 32 == 0,
             "V4.1 rounds window KV per 32, main KV per 16 and index keys per 32: head_dim and index_head_dim % 32")
        if self.vision_n_layers:
            need(self.vision_dim % self.vision_n_heads == 0 and (self.vision_dim // self.vision_n_heads) % 4 == 0,
                 f"vision_dim {self.vision_dim} over {self.vision_n_heads} heads must leave a head width divisible by "
                 f"4 (the 2D rotary splits it into row and column pairs)")
            need(self.vision_patch_size > 0 and self.vision_downsample_ratio > 0 and self.vision_max_n_token > 2
                 and self.vision_min_pixels >= 0 and self.vision_inter_dim > 0,
                 "vision_patch_size, vision_downsample_ratio, vision_inter_dim must be positive, vision_max_n_token > 2")
            need(0 <= self.image_token_id < self.vocab_size, f"image_token_id {self.image_token_id} outside the vocabulary")
        if self.engram_layer_ids:
            need(len(self.engram_num_embeddings) == len(self.engram_layer_ids),
                 "engram_num_embeddings needs one table size per Engram layer")
            need(self.engram_max_ngram_size >= 2 and self.engram_n_heads > 0 and self.engram_head_dim % 32 == 0,
                 "Engram needs max_ngram_size ≥ 2, n_heads > 0 and head_dim divisible by 32 (one scale per 32)")


_NUMERIC_FIELDS: dict[str, dict[str, Any]] = {
    # what transformers computes: fp32 activations, no fake quantisation anywhere
    # (token by token, so prefill chunks and decode steps agree bit for bit with a full forward)
    "transformers": dict(compute_dtype="float32", kv_quant_sim=False, index_quant_sim=False, act_quant_sim=False,
                         batch_invariant=True),
    # DeepSeek's reference with bf16 weights: KV FP8 rounding + FP4 index keys, no activation quant
    "reference-bf16": dict(compute_dtype="bfloat16", kv_quant_sim=True, index_quant_sim=True, act_quant_sim=False,
                           batch_invariant=False),
    # DeepSeek's reference as released: all fake quantisation on
    "reference-fp8": dict(compute_dtype="bfloat16", kv_quant_sim=True, index_quant_sim=True, act_quant_sim=True,
                          batch_invariant=False),
}


# ---------------------------------------------------------------------- presets
def _v4_flash(**kw) -> ModelConfig:
    return ModelConfig(**{"name": "v4-flash", **kw})


def _v41_flash(**kw) -> ModelConfig:
    base = dict(
        name="v4.1-flash", family="v4.1", dim=5120, n_layers=40, n_heads=64, head_dim=512, rope_head_dim=64,
        q_lora_rank=1280, o_groups=8, o_lora_rank=1024, n_routed_experts=384, n_activated_experts=6,
        moe_inter_dim=2304, n_hash_layers=0, norm_eps=1e-20, compress_ratios=(0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0),
        index_n_heads=32, index_head_dim=128, index_topk=512, n_mtp_layers=3, weight_block_size=32,
        kv_source_layers=(2, 8, 14, 20), index_source_layers=(2, 8, 14, 20, 24, 28, 32, 36),
        candidate_source_layer=20, candidate_topk_blocks=2048, candidate_block_size=8,
        engram_layer_ids=(1, 14), engram_num_embeddings=(384006168, 384016682), engram_max_ngram_size=4,
        engram_vocab_size=16000000, engram_n_heads=8, engram_head_dim=256, engram_pad_id=2,
        engram_compressed_vocab_size=99092, dspark_block_size=5, dspark_noise_token_id=128799,
        dspark_target_layer_ids=(37, 38, 39), dspark_markov_rank=256, dspark_n_routed_experts=128,
        dspark_n_activated_experts=3, vision_n_layers=32, pad_token_id=2,
    )
    base.update(kw)
    return ModelConfig(**base)


def _tiny_v4(**kw) -> ModelConfig:
    """A V4-architecture model small enough for CPU tests: every layer kind, hash and top-k routing, MTP."""
    base = dict(
        name="tiny-v4", vocab_size=129280, dim=128, n_layers=6, n_heads=4, head_dim=128, rope_head_dim=64,
        q_lora_rank=128, o_groups=2, o_lora_rank=64, n_routed_experts=8, n_activated_experts=2, moe_inter_dim=128,
        n_hash_layers=2, window_size=32, compress_ratios=(0, 4, 16, 4, 16, 4, 0), index_n_heads=8,
        index_head_dim=64, index_topk=8, max_position_embeddings=4096, weight_block_size=128,
    )
    base.update(kw)
    return ModelConfig(**base)


def _tiny_v41(**kw) -> ModelConfig:
    """A V4.1-architecture model small enough for CPU tests, the shapes of the golden case v41_tiny_s4321 with the
    real vocabulary: SWA, ratio-2 and ratio-1 KV sources, Reuse, Reindex, candidate blocks, Engram on two layers."""
    base = dict(
        name="tiny-v41", family="v4.1", vocab_size=129280, dim=64, n_layers=10, n_heads=4, head_dim=64,
        rope_head_dim=16, q_lora_rank=64, o_groups=2, o_lora_rank=32, n_routed_experts=8, n_activated_experts=3,
        moe_inter_dim=64, n_hash_layers=0, norm_eps=1e-20, window_size=16,
        compress_ratios=(0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0), index_n_heads=8, index_head_dim=32, index_topk=8,
        n_mtp_layers=3, weight_block_size=32, kv_source_layers=(2, 4, 6), index_source_layers=(2, 4, 6, 8),
        candidate_source_layer=6, candidate_topk_blocks=3, candidate_block_size=4, engram_layer_ids=(1, 4),
        engram_num_embeddings=(630, 834), engram_max_ngram_size=4, engram_vocab_size=97, engram_n_heads=2,
        engram_head_dim=32, engram_pad_id=2, engram_compressed_vocab_size=99092, dspark_block_size=5,
        dspark_noise_token_id=128799, dspark_target_layer_ids=(7, 8, 9), dspark_markov_rank=16,
        dspark_n_routed_experts=4, dspark_n_activated_experts=2, pad_token_id=2, max_position_embeddings=4096,
        # a 2-layer ViT of width 32 (head width 16), the real patch and downsample; images of up to 62 span
        # positions, upscaled to at least 56x56 pixels: a few hundred patches, cheap on a CPU
        vision_n_layers=2, vision_dim=32, vision_n_heads=2, vision_inter_dim=64, vision_max_n_token=62,
        vision_min_pixels=56 * 56,
    )
    base.update(kw)
    return ModelConfig(**base)


PRESETS = {
    "v4-flash": _v4_flash,
    # 0731 keeps the V4 backbone shapes; its DSpark draft namespace is the V4.1-Flash II issue's business.
    "v4-flash-0731": lambda **kw: _v4_flash(**{"name": "v4-flash-0731", **kw}),
    "v4.1-flash": _v41_flash,
    "tiny-v4": _tiny_v4,
    "tiny-v41": _tiny_v41,
}


def preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[name](**overrides)


# ---------------------------------------------------------------------- config.json reading
# HF name -> inference name (DeepSeek's inference/config.json uses the short names)
_HF_TO_INFERENCE = {
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "qk_rope_head_dim": "rope_head_dim",
    "moe_intermediate_size": "moe_inter_dim",
    "num_experts_per_tok": "n_activated_experts",
    "num_hash_layers": "n_hash_layers",
    "scoring_func": "score_func",
    "routed_scaling_factor": "route_scale",
    "rms_norm_eps": "norm_eps",
    "sliding_window": "window_size",
    "num_nextn_predict_layers": "n_mtp_layers",
    "kv_source_layer_ids": "kv_source_layers",
    "index_source_layer_ids": "index_source_layers",
    "candidate_source_layer_id": "candidate_source_layer",
    "engram_pad_token_id": "engram_pad_id",
    "dspark_num_experts_per_tok": "dspark_n_activated_experts",
    "n_mtp_layers": "n_mtp_layers",
}
# HF vision_config name -> ModelConfig field (DeepSeek's inference names)
_HF_VISION = {
    "num_hidden_layers": "vision_n_layers", "hidden_size": "vision_dim", "num_attention_heads": "vision_n_heads",
    "intermediate_size": "vision_inter_dim", "patch_size": "vision_patch_size", "rope_theta": "vision_rope_theta",
    "downsample_ratio": "vision_downsample_ratio", "max_image_tokens": "vision_max_n_token",
    "min_pixels": "vision_min_pixels", "max_wh_ratio": "vision_max_wh_ratio",
}
_TRANSFORMERS_LAYER_TYPES = {"sliding_attention": "window", "compressed_sparse_attention": "csa",
                             "heavily_compressed_attention": "hca"}
_FIELDS = {f.name: f for f in dataclasses.fields(ModelConfig)}


def config_from_dict(raw: dict[str, Any], *, name: str = "custom", source: str = "<dict>") -> ModelConfig:
    """Build a ModelConfig from any of the three config.json spellings; unknown keys are ignored."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a JSON object, found {type(raw).__name__}")
    d = dict(raw)
    if isinstance(d.get("text_config"), dict):  # V4.1 HF layout nests the language model
        outer = {k: v for k, v in d.items() if k != "text_config"}
        d = {**outer, **d["text_config"]}
        if isinstance(d.get("vision_config"), dict):
            for hf, ours in _HF_VISION.items():
                if hf in d["vision_config"]:
                    d.setdefault(ours, d["vision_config"][hf])
    model_type = str(d.get("model_type", ""))
    family: Family = "v4.1" if ("v41" in model_type or "kv_source_layers" in d or "kv_source_layer_ids" in d) else "v4"
    out: dict[str, Any] = {"name": name, "family": family}
    if family == "v4.1":
        out.update(n_hash_layers=0, norm_eps=1e-20, weight_block_size=32, pad_token_id=2)
    for key, value in d.items():
        target = _HF_TO_INFERENCE.get(key, key)
        if target in _FIELDS and target not in ("name", "family", "sharding"):
            out[target] = value
    # rope scaling (HF) -> inference names
    rs = d.get("rope_scaling") or d.get("rope_parameters") or {}
    if isinstance(rs, dict) and isinstance(rs.get("compress"), dict):  # transformers: {main: .., compress: ..}
        main, rs = rs.get("main") or {}, rs["compress"]
        if "rope_theta" in main:
            out["rope_theta"] = main["rope_theta"]
        if "rope_theta" in rs:
            out["compress_rope_theta"] = rs["rope_theta"]
        if rs.get("rope_type") == "yarn":
            rs = {k: v for k, v in rs.items() if k != "rope_theta"}
        else:
            out["original_seq_len"], rs = 0, {}
    if isinstance(rs, dict) and rs:
        if "factor" in rs:
            out["rope_factor"] = rs["factor"]
        if "original_max_position_embeddings" in rs:
            out["original_seq_len"] = rs["original_max_position_embeddings"]
        for k in ("beta_fast", "beta_slow"):
            if k in rs:
                out[k] = rs[k]
        if "rope_theta" in rs and "rope_theta" not in d:
            out["rope_theta"] = rs["rope_theta"]
    # transformers 5.24 spelling of the schedule
    if "compress_ratios" not in d and "layer_types" in d:
        rates = d.get("compress_rates") or {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
        try:
            ratios = [0 if t == "sliding_attention" else int(rates[t]) for t in d["layer_types"]]
        except KeyError as e:
            raise ConfigError(f"{source}: unknown layer type {e.args[0]!r} in layer_types") from None
        n_mtp = int(out.get("n_mtp_layers", 1))
        out["compress_ratios"] = tuple(ratios) + (0,) * n_mtp
    if "mlp_layer_types" in d and "num_hash_layers" not in d and "n_hash_layers" not in d:
        out["n_hash_layers"] = sum(1 for t in d["mlp_layer_types"] if t == "hash_moe")
    if "n_layers" in out and "compress_ratios" in out:
        if len(out["compress_ratios"]) < int(out["n_layers"]):
            n_mtp = int(out.get("n_mtp_layers", 1))
            raise ConfigError(f"{source}: compress_ratios has {len(out['compress_ratios'])} entries, expected one per "
                              f"layer plus one per MTP layer: {out['n_layers']} + {n_mtp} = {int(out['n_layers']) + n_mtp}")
        n_mtp = len(out["compress_ratios"]) - int(out["n_layers"])
        if "n_mtp_layers" not in out or n_mtp != out["n_mtp_layers"]:
            # official V4 configs list one ratio per MTP layer; pad or trim to what the config declares
            declared = int(out.get("n_mtp_layers", max(n_mtp, 0)))
            ratios = list(out["compress_ratios"])[: int(out["n_layers"])]
            ratios += list(out["compress_ratios"])[int(out["n_layers"]):][:declared]
            ratios += [0] * (int(out["n_layers"]) + declared - len(ratios))
            out["compress_ratios"] = tuple(ratios)
            out["n_mtp_layers"] = declared
    # quantisation
    q = d.get("quantization_config") or {}
    if "dtype" in d and d["dtype"] in ("fp8", "bf16"):
        out["weight_dtype"] = d["dtype"]
    elif q:
        out["weight_dtype"] = "fp8" if q.get("quant_method") == "fp8" else "bf16"
    elif "torch_dtype" in d or "dtype" in d:
        out["weight_dtype"] = "bf16"
    if isinstance(q, dict) and q.get("weight_block_size"):
        wbs = q["weight_block_size"]
        if not (isinstance(wbs, list) and len(wbs) == 2 and wbs[0] == wbs[1]):
            raise ConfigError(f"{source}: weight_block_size must be a square [B, B], found {wbs!r}")
        out["weight_block_size"] = int(wbs[0])
    ed = d.get("expert_dtype", q.get("expert_dtype") if isinstance(q, dict) else None)
    if ed is None and q and model_type.startswith("deepseek_v4"):
        ed = "fp4"  # every released V4-family checkpoint has FP4 experts; V4-Flash's first config.json omits the key
    out["expert_dtype"] = ed if ed in ("fp4", "fp8") else ("fp8" if out.get("weight_dtype", "fp8") == "fp8" and ed is None and q else "bf16")
    if out.get("weight_dtype") == "bf16":
        out["expert_dtype"] = "bf16"
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if isinstance(out.get(key), list):
            out[key] = out[key][0]
    if out.get("pad_token_id") is None:
        out["pad_token_id"] = out.get("eos_token_id", 1)
    # coerce types so the config stays hashable and exact
    for key, value in list(out.items()):
        f = _FIELDS[key]
        if isinstance(value, list):
            out[key] = tuple(value)
        elif f.type in ("int",) and isinstance(value, float) and value.is_integer():
            out[key] = int(value)
        elif f.type == "float" and isinstance(value, int) and not isinstance(value, bool):
            out[key] = float(value)
        if value is None and f.type in ("int", "float"):
            out.pop(key)
    try:
        return ModelConfig(**out)
    except TypeError as e:
        raise ConfigError(f"{source}: {e}") from None


def load_config(path: str | os.PathLike, *, name: str | None = None) -> ModelConfig:
    """Read `config.json` (or the directory holding it), preferring `inference/config.json` when beside it."""
    path = os.fspath(path)
    if os.path.isdir(path):
        cfg_path = os.path.join(path, "config.json")
    else:
        cfg_path = path
    if not os.path.exists(cfg_path):
        raise ConfigError(f"{path}: no config.json found")
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{cfg_path}: malformed JSON ({e})") from None
    return config_from_dict(raw, name=name or os.path.basename(os.path.dirname(os.path.abspath(cfg_path))), source=cfg_path)


def yarn_frequencies(cfg: ModelConfig, layer: int):
    """Per-pair rotation frequencies ω_k (numpy float32) for the layer, with YaRN on compressed layers."""
    import numpy as np

    theta, yarn = cfg.layer_rope(layer)
    dim = cfg.rope_head_dim
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    if yarn and cfg.original_seq_len > 0:
        def corr(rot):
            return dim * math.log(cfg.original_seq_len / (rot * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(corr(cfg.beta_fast)), 0)
        high = min(math.ceil(corr(cfg.beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
        smooth = 1 - ramp
        freqs = freqs / cfg.rope_factor * (1 - smooth) + freqs * smooth
    return freqs.astype(np.float32)
