"""Which implementation each op runs: `cfg.kernels` ("auto" | "pallas" | "xla" | "reference", optionally with
per-op overrides: "auto+chunk_attention=pallas") and, for "auto", the H200 measurements of
`python -m dsjax.bench.kernels` (docs/benchmarks.md, "Kernels").

"auto" picks the Pallas kernel only where it was measured faster than the XLA path on the GPU, and XLA
everywhere else (CPU, fp32 numerics, batch-invariant mode, tensor-parallel attention). Choices are made at trace
time (shapes are static), logged once per op and shape on the `dsjax.kernels` logger, and kept for `choices()`
(the API reports them in generation stats).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from dsjax.config import split_kernels

log = logging.getLogger("dsjax.kernels")
_CHOSEN: dict[tuple, str] = {}


def _measured_faster(op: str, rows: int, fmt: str | None, chunk: int) -> bool:
    """H200, jax 0.11.2, 2026-11-30 to 12-05 (docs/benchmarks.md): where the Pallas kernel beat XLA."""
    if op == "chunk_attention":  # the Mosaic kernel (12-05, no exchange, whole tiles unmasked): window 2.4x, CSA
        # 1.65-1.7x at 8k-1M, HCA 2.1x at 8k, 1.52x at 128k (1,024 entries), 1.37x at 256k, 1.28x at 512k, 1.22x at
        # 1M (8,192; 0.79x on 12-02, when XLA's dense path was kept there); the V4-Flash slice prefill 2-2.5% faster
        # at 16k / 64k (12-02)
        return True
    if op == "sparse_mqa":      # V4 rows: 1.37-1.46x at 32 slots x 6 queries, 0.7-0.95x at 1 slot; V4.1's FP8
        # window + FP4 rows: 1.10-1.12x at 32 slots, 0.48-0.73x at 1. Prefill shapes were not timed alone, and a
        # 1,024-token slice prefill ran slower with kernels
        return rows >= 32 and chunk <= 16
    if op == "moe_gemm":        # FP4: 2.5-3.1x at 1-8 tokens, 19x at 1024; FP8 2.3x / 3.7x, bf16 1.95x / 3.0x at
        return True             # 1 / 8 tokens (12-01, after the tile map's searchsorted loop went)
    if op == "indexer_topk":    # 1M context: 1.30x at 1 slot x 6 queries, 0.94x at 32 slots; a prefill chunk's
        # scores (`layers.chunk_indexer`, 12-04): 4.6x at 1,024 queries x 64k-128k keys, 32 or 64 heads
        return rows <= 8 or chunk >= 64
    if op == "quant_linear":    # FP8 at ≤ 32 rows (`_covers`): wq_b 3.3-3.65x; the step -14% / -7.5% (V4-Flash
        # slice), -22% / -13% (V4.1 slice). Small projections are launch-bound either way (0.87-1.8x)
        return fmt == "fp8"
    if op == "mhc_sinkhorn":    # 2.3x at 192, 2.2x at 2,048 (vs the scan); at decode / verify the V4.1 slice step
        return True             # with XLA's scan instead: 4.24 -> 5.48 ms / 9.72 -> 11.54 ms (2026-12-02)
    return False


def _covers(op: str, rows: int, chunk: int) -> bool:
    """The shapes an op's kernel is built for; elsewhere even kernels="pallas" keeps XLA."""
    if op == "quant_linear":    # a split-K GEMV: faster than XLA at 1-32 rows (tokens x batch; a flattened [n, D]
        # input counts all n), 0.35-0.64x at 1,024: prefill chunks keep XLA's GEMM
        return rows <= 32
    return True


def choose(cfg, op: str, *, rows: int, dtype, fmt: str | None = None, sharded: bool = False, chunk: int = 1,
           operands=(), entries: int = 0) -> str:
    """The implementation of `op` for a call with `rows` query rows / tokens in compute `dtype`, `chunk` tokens
    per sequence (1 decode, k+1 verify, more for prefill chunks). `operands`: the large arrays the kernel would
    index (KV caches); one the Triton lowering cannot address (`kernels.common.offsets_fit`) means XLA.
    `entries`: compressed entries every query of a chunk may see (an HCA layer's cache; 0 elsewhere): logged with
    the choice, which no longer depends on it (the chunk kernel beats XLA at every measured context)."""
    from dsjax.kernels.common import offsets_fit

    mode, overrides = split_kernels(cfg.kernels)
    mode = overrides.get(op, mode)                  # an override: "pallas" or "xla" for this op alone
    addressable = all(offsets_fit(a) for a in operands)
    if mode in ("xla", "reference"):
        impl = "xla" if mode == "xla" or op != "moe_gemm" else "reference"
    else:
        usable = (jnp.dtype(dtype) == jnp.bfloat16 and not cfg.batch_invariant and not sharded and addressable
                  and (fmt or "bf16") != "f32")
        usable = usable and _covers(op, rows, chunk)
        if mode == "pallas":
            impl = "pallas" if usable else "xla"
        else:
            impl = "pallas" if usable and jax.default_backend() == "gpu" and _measured_faster(op, rows, fmt, chunk) else "xla"
    key = (op, mode, rows, chunk, str(jnp.dtype(dtype)), fmt, sharded, addressable, entries)
    if key not in _CHOSEN:
        _CHOSEN[key] = impl
        log.info("%s: %s -> %s", op, _describe(key), impl)
    return impl


def _describe(key) -> str:
    op, mode, rows, chunk, dtype, fmt, sharded, addressable, entries = key
    return (f"kernels={mode} rows={rows} chunk={chunk} dtype={dtype} fmt={fmt}{' sharded' if sharded else ''}"
            f"{f' entries={entries}' if entries else ''}"
            f"{'' if addressable else ' (an operand past the int32 offsets of the Triton lowering)'}")


def choices() -> dict[str, list[str]]:
    """Every choice made so far in this process, per op: 'kernels=… rows=… chunk=… dtype=… fmt=… -> impl'."""
    out: dict[str, list[str]] = {}
    for key, impl in _CHOSEN.items():
        out.setdefault(key[0], []).append(f"{_describe(key)} -> {impl}")
    return out
