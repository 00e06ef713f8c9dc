"""Architectures `dsjax train` builds: V4 in miniature, every layer kind present.

Both have window-only, CSA (ratio 4 + indexer) and HCA (ratio 16) layers, hash-routed MoE in the first layers and
top-k MoE after, mHC streams, and one MTP layer. "small" is the H200 run's model (12.7M parameters with 6,010 vocabulary
rows, 9.6M without embedding/head; its official-layout checkpoint, FP8 linears + FP4 experts + bf16
embedding/head, is ~15 MB: within the 16 MB the package allows); "smoke" is a CPU-sized one for CI and quick checks.

The indexer gets no gradient (loss.py says why), so "small" keeps index_topk = 128 = the compressed entries of
a 512-token training window: within the trained context every CSA layer attends to all its compressed entries
and an untrained indexer selects nothing away; beyond it, selection is by untrained scores (training the indexer
by distillation, as V3.2/V4 do, is left).
"""

from __future__ import annotations

from dsjax.config import ModelConfig, preset

MODELS = {
    "small": dict(dim=256, n_layers=6, n_heads=4, head_dim=128, rope_head_dim=64, q_lora_rank=192, o_groups=2,
                  o_lora_rank=128, n_routed_experts=8, n_activated_experts=2, moe_inter_dim=128, n_hash_layers=2,
                  window_size=128, compress_ratios=(0, 4, 16, 4, 16, 0, 0), index_n_heads=8,
                  index_head_dim=64, index_topk=128, max_position_embeddings=4096),
    "smoke": dict(dim=64, n_layers=4, n_heads=2, head_dim=96, rope_head_dim=32, q_lora_rank=64, o_groups=2,
                  o_lora_rank=32, n_routed_experts=4, n_activated_experts=2, moe_inter_dim=64, n_hash_layers=1,
                  window_size=16, compress_ratios=(0, 4, 16, 0, 0), index_n_heads=2, index_head_dim=32,
                  index_topk=4, max_position_embeddings=1024),
}


def model_config(name: str, head_vocab_size: int) -> ModelConfig:
    """The deployment config (FP8 linears, FP4 experts: the official layout's formats) of a named model."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    return preset("tiny-v4", head_vocab_size=head_vocab_size, **MODELS[name]).replace(name=f"dsjax-train-{name}")
