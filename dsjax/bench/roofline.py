"""The physical limit of a step, and the machine rates it is divided by.

A decode or verify step must at least read the weights it touches, the KV it attends to and its draft's weights
once (specdec-and-perf.md §3.1): `step_bytes` counts them from the weight tree itself, with the expert tax — the
distinct experts a batch of n routed tokens touches, E·(1 − (1 − k/E)^n) under independent routing (an upper
bound for trained routers, close to exact for random ones). `floor_ms` divides by the copy bandwidth measured in
the same run and adds an all-reduce term for tensor parallelism. `flops_per_token` gives prefill MFU.
"""

from __future__ import annotations

import jax
import numpy as np

from dsjax.config import ModelConfig
from dsjax.weights import Linear, describe, is_info

AR_US = 5.0  # small-message all-reduce inside one NVLink host (NCCL, specdec-and-perf.md §3.1)


def torch_roofline() -> dict:
    """Copy bandwidth (bytes read + written per second) and bf16 matmul FLOP/s through torch, this run (None
    unless JAX runs on a GPU: the figures must describe the device the benchmark times)."""
    if jax.default_backend() != "gpu":
        return {"copy_GBps": None, "matmul_TFLOPs": None, "note": f"JAX backend is {jax.default_backend()}"}
    try:
        import torch
    except ImportError:
        return {"copy_GBps": None, "matmul_TFLOPs": None, "note": "torch not installed"}
    if not torch.cuda.is_available():
        return {"copy_GBps": None, "matmul_TFLOPs": None, "note": "torch sees no GPU"}
    src = torch.empty(2 ** 32, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")

    def mean_ms(fn, n=10):
        for _ in range(3):
            fn()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(n):
            fn()
        e.record()
        torch.cuda.synchronize()
        return s.elapsed_time(e) / n

    copy_ms = mean_ms(lambda: dst.copy_(src))
    mm_ms = mean_ms(lambda: a @ b)
    out = {"copy_GBps": 2 * src.numel() / copy_ms / 1e6, "matmul_TFLOPs": 2 * 8192 ** 3 / mm_ms / 1e9,
           "method": "torch: 4 GiB device-to-device copy (read + write), 8192^3 bf16 matmul, mean of 10"}
    del src, dst, a, b
    torch.cuda.empty_cache()
    return out


def _bytes(node) -> int:
    leaves = jax.tree.leaves(node, is_leaf=is_info)
    return int(sum(np.prod(i.shape) * np.dtype(i.dtype).itemsize for i in leaves))


def _routed(moe) -> tuple[int, int]:
    """(bytes of the non-routed part of a MoE block, bytes of one routed expert incl. scales)."""
    experts = (moe.w1, moe.w2, moe.w3)
    per_expert = sum(_bytes(w) for w in experts) // moe.w1.weight.shape[0]
    gate_tables = _bytes(moe.tid2eid) if moe.tid2eid is not None else 0  # rows per token, not the table
    return _bytes(moe) - sum(_bytes(w) for w in experts) - gate_tables, per_expert


def unique_experts(cfg: ModelConfig, tokens: int, experts: int | None = None, topk: int | None = None) -> float:
    """Expected distinct experts `tokens` independently routed tokens touch (specdec-and-perf.md §3.1)."""
    E = experts or cfg.n_routed_experts
    k = topk or cfg.n_activated_experts
    return E * (1.0 - (1.0 - k / E) ** tokens)


def kv_read_bytes(cfg: ModelConfig, layer: int, ctx: int, batch: int, T: int) -> float:
    """KV bytes one layer reads for `batch` rows of `T` queries at context `ctx`: the window rows, every index
    key (CSA, read once for the T queries), the top-k picks per query (CSA) or every compressed entry (HCA)."""
    from dsjax import kv_rows

    if cfg.family == "v4.1":
        return _kv_read_bytes41(cfg, layer, ctx, batch, T)
    main = kv_rows.main_row_bytes(cfg) if kv_rows.main_rows_compact(cfg) else cfg.head_dim * 2
    idx = kv_rows.index_row_bytes(cfg) if kv_rows.index_rows_compact(cfg) else cfg.index_head_dim * 2
    ratio, kind = cfg.layer_ratio(layer), cfg.layer_kind(layer)
    per_row = min(ctx + T, cfg.window_size) * main
    if ratio:
        entries = (ctx + T) // ratio
        if kind == "csa":
            per_row += entries * idx + T * min(cfg.index_topk, entries) * main
        else:
            per_row += entries * main
    return float(batch * per_row)


def _kv_read_bytes41(cfg: ModelConfig, layer: int, ctx: int, batch: int, T: int) -> float:
    """V4.1 (CSA2): the window rows; a layer that owns an indexer (an index source) reads every index key of its
    ratio, every compressed layer the top-k main rows per query (Reuse layers take their source's picks)."""
    from dsjax.v41_rows import row_shapes
    from dsjax.v41_weights import owns_indexer

    rows = row_shapes(cfg)
    size = {k: int(np.prod(rows[k][0])) * np.dtype(rows[k][1]).itemsize for k in ("window", "main", "index")}
    per_row = min(ctx + T, cfg.window_size) * size["window"]
    ratio = cfg.layer_ratio(layer)
    if ratio:
        entries = (ctx + T) // ratio
        if owns_indexer(cfg, layer):
            per_row += entries * size["index"]
        per_row += T * min(cfg.index_topk, entries) * size["main"]
    return float(batch * per_row)


def _engram_bytes(cfg: ModelConfig, block, n_tokens: int) -> tuple[int, float]:
    """(bytes of a V4.1 block's Engram table, bytes `n_tokens` tokens read from it: one row per hash column)."""
    engram = getattr(block, "engram", None)
    if engram is None:
        return 0, 0.0
    from dsjax.v41_weights import engram_columns

    table = _bytes(engram.embed)
    return table, float(n_tokens * engram_columns(cfg) * table / engram.embed.weight.shape[0])


def step_bytes(cfg: ModelConfig, *, batch: int, T: int, ctx: int, k_draft: int = 0) -> dict:
    """Bytes one step must read: the target forward over `batch` x `T` tokens (verify: T = k+1), its KV at
    context `ctx`, and — with `k_draft` > 0 — the draft: V4's MTP (a catch-up chunk of up to k+1 positions, then
    k-1 chained single-token steps, each with the LM head) or V4.1's DSpark (each stage once over its block)."""
    tree = describe(cfg)
    n = batch * T
    dense = routed = kv = 0.0
    for layer, block in enumerate(tree.layers):
        rest, per_expert = _routed(block.ffn)
        table, rows_read = _engram_bytes(cfg, block, n)  # V4.1: a lookup reads rows, not the table
        dense += _bytes(block) - _bytes(block.ffn) + rest - table + rows_read
        routed += unique_experts(cfg, n) * per_expert
        kv += kv_read_bytes(cfg, layer, ctx, batch, T)
    head = _bytes(tree.head) + _bytes(tree.norm) + _bytes(tree.hc_head) + n * cfg.dim * 2  # + embedding rows
    draft = 0.0
    if k_draft and tree.mtp and cfg.family == "v4.1":
        # DSpark: every stage once over the block's S positions (its own experts, top-k of them), the head once
        S = batch * cfg.dspark_block_size
        for m in tree.mtp:
            rest, per_expert = _routed(m.block.ffn)
            draft += _bytes(m) - _bytes(m.block.ffn) + rest + per_expert * unique_experts(
                cfg, S, cfg.dspark_n_routed_experts, cfg.dspark_n_activated_experts)
        draft += _bytes(tree.head)
    elif k_draft and tree.mtp:
        m = tree.mtp[0]
        rest, per_expert = _routed(m.block.ffn)
        mtp_dense = _bytes(m) - _bytes(m.block.ffn) + rest
        catch_up = mtp_dense + unique_experts(cfg, batch * (k_draft + 1)) * per_expert
        chained = (k_draft - 1) * (mtp_dense + unique_experts(cfg, batch) * per_expert)
        draft = catch_up + chained + k_draft * _bytes(tree.head)
    total = dense + routed + kv + head + draft
    return {"dense_weights": dense, "routed_experts": routed, "kv": kv, "head": head, "draft": draft,
            "total": total, "unique_experts_per_layer": unique_experts(cfg, n)}


def floor_ms(total_bytes: float, copy_GBps: float | None, *, tp: int = 1, all_reduces: int = 0) -> float | None:
    """Bandwidth floor of a step on `tp` devices (bytes split evenly), plus `all_reduces` x AR_US when tp > 1."""
    if not copy_GBps:
        return None
    return total_bytes / tp / (copy_GBps * 1e9) * 1e3 + (all_reduces * AR_US / 1e3 if tp > 1 else 0.0)


def all_reduces_per_step(cfg: ModelConfig) -> int:
    """Critical-path all-reduces of a TP forward: after attention and after the MoE, per layer."""
    return 2 * cfg.n_layers


def flops_per_token(cfg: ModelConfig, ctx: float) -> float:
    """Forward FLOPs of one token at context `ctx` (2 per multiply-add): the active weights (attention, shared
    and top-k routed experts, head) plus attention scores/values over window + compressed entries and the CSA
    indexer over every index key. Prefill MFU uses the mean context of the prompt."""
    tree = describe(cfg)
    mults = 0.0
    H, d = cfg.n_heads, cfg.head_dim

    def weight_elems(node) -> float:
        nodes = jax.tree.leaves(node, is_leaf=lambda x: isinstance(x, Linear) or is_info(x))
        total = 0.0
        for nd in nodes:
            info = nd.weight if isinstance(nd, Linear) else nd
            shape = info.logical_shape or info.shape
            if len(shape) >= 2:
                total += float(np.prod(shape))
        return total

    for layer, block in enumerate(tree.layers):
        moe = block.ffn
        per_expert = weight_elems((moe.w1, moe.w2, moe.w3)) / cfg.n_routed_experts
        mults += weight_elems(block) - weight_elems((moe.w1, moe.w2, moe.w3, moe.tid2eid))
        mults += cfg.n_activated_experts * per_expert
        if getattr(block, "engram", None) is not None:   # V4.1 Engram: a table lookup (rows gathered), no matmul
            mults -= weight_elems(block.engram.embed)
        ratio, kind = cfg.layer_ratio(layer), cfg.layer_kind(layer)
        entries = min(ctx, cfg.window_size)
        if ratio:
            comp = ctx / ratio
            picks = kind in ("csa", "csa2")          # V4.1's CSA2: top-k picks at every compressed layer
            entries += min(cfg.index_topk, comp) if picks else comp
            scores = kind == "csa" or (kind == "csa2" and layer in cfg.index_source_layers)  # Reuse layers don't
            if scores:
                mults += comp * cfg.index_n_heads * cfg.index_head_dim
        mults += 2 * H * d * entries  # scores and values
    mults += cfg.vocab_size * cfg.dim
    return 2.0 * mults
