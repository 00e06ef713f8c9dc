"""Kernel timings on one GPU: each op's `pallas` and `xla` paths side by side, against the roofline measured in
the same run (torch device-to-device copy bandwidth, read + write; torch 8192³ bf16 matmul), with the
pallas-vs-xla difference checked on the same inputs. Writes one JSON line per measurement.

    python -m dsjax.bench.kernels --out kernels.jsonl                 # every op, the issue's shapes
    python -m dsjax.bench.kernels --ops moe --sweep --out moe.jsonl   # block-size sweep of one op

Shapes (V4-Flash): sparse MQA decode attention — 64 heads x 512, 584-byte FP8 rows, k+1 = 6 verify queries per
slot, window 128, at 64k context the CSA layer's 512 picks of 16,384 entries and the HCA layer's 512 entries, at
1M context (batch 1) 8,192 HCA entries and 512 picks of 262,144; lightning indexer — 64 heads x 128, 68-byte FP4
keys, 262,144 entries (1M context), top-512; MoE — 256 experts 4096 -> 2048, top-6, FP4 (and FP8, bf16).
Chunk (prefill) attention — a 1,024-token chunk ending at 8k / 64k / 128k / 1M context, 64 heads x 512, FP8
rows: the window layer (128 window keys), the HCA layer (+ every completed entry, context/128) and the CSA layer
(+ 512 picks of context/4); its figure is useful TFLOP/s (4·d FLOPs per head per visible key) against the bf16
matmul rate of the same run (torch and jnp, 8192³), timed by device time from a profiler trace (its host
dispatch, ~0.5 ms a call, outlasts the short cases' kernels; the wall time is kept as `wall_us`).
Bytes are what the op must read at least: the distinct rows / experts selected, the queries, the output.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsjax import kv_rows, quant
from dsjax.bench.report import run_info
from dsjax.bench.roofline import torch_roofline
from dsjax.kernels import chunk_attention, indexer_topk, mhc_sinkhorn, moe_gemm, sparse_mqa
from dsjax.kernels.common import IndexRowFormat, MainRowFormat
from dsjax.kernels.moe_gemm import pallas_triton as moe_gemm_kernel
from dsjax.layers import radix_topk
from dsjax.layers.lm_head import lm_head
from dsjax.weights import stored_linear


def time_us(fn, *args, calls: int = 20, rounds: int = 3) -> float:
    """Per-call time of a jitted fn: `calls` dispatches back to back (the device queue stays full), best round."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def time_us_looped(fn, *args, repeat: int = 100, rounds: int = 3) -> float:
    """Device time per call of a small op: `repeat` calls inside one jitted loop (one dispatch, so the host's
    ~20-60 µs per dispatch drops out, as in the model's device-resident step). Each call's inputs take 0 x the
    last outputs' first elements (`linked_call`), so no call can be hoisted out of the loop, and every output is
    used (a Pallas call whose output nothing reads is dead code to XLA: two kernels timed in one call would be
    one). The links' tiny adds are timed too (on an H100 within the MoE op's spread, docs/benchmarks.md)."""

    return time_us(looped_calls(fn, repeat), *args, calls=1, rounds=rounds) / repeat


LINKED_ELEMENTS = 1 << 16   # inputs up to this size take the link too (the routing's weights and ids; not weights)


def linked_input(a, link):
    """a, made to depend on link (0 x the previous call's outputs) without changing a value: + link for floats, +
    (link != link) (0, but not provably so: NaN) for integers. Other inputs pass as they are."""
    if not isinstance(a, jax.Array) or a.size > LINKED_ELEMENTS:
        return a
    if jnp.issubdtype(a.dtype, jnp.floating):
        return a + link.astype(a.dtype)
    if jnp.issubdtype(a.dtype, jnp.integer):
        return a + (link != link).astype(a.dtype)
    return a


def linked_call(fn, rest, carry):
    """One call of fn whose inputs take 0 x the previous call's outputs' first elements: (x, link) -> (x, the next
    link). x and every small input of `rest` take it (`linked_input`): otherwise XLA may hoist out of the loop what
    depends on them alone (it does on the CPU; the MoE op's routing glue depends only on the routing weights and
    ids). So no call's work can be hoisted or dropped as dead code; the large inputs (weight stacks) stay as they
    are, as a model's layers read theirs."""
    x, link = carry
    ys = jax.tree.leaves(fn(x + link.astype(x.dtype), *jax.tree.map(lambda a: linked_input(a, link), rest)))
    return x, sum(y.ravel()[0].astype(jnp.float32) for y in ys) * 0.0


def looped_calls(fn, repeat: int):
    """`time_us_looped`'s jitted loop: `repeat` calls of fn, each call's inputs linked to every output of the call
    before (`linked_call`)."""
    body = lambda rest, i, carry: linked_call(fn, rest, carry)  # noqa: E731
    return jax.jit(lambda x, *rest: jax.lax.fori_loop(0, repeat, functools.partial(body, rest),
                                                      (x, jnp.float32(0.0)))[1])


def device_us(fn, *args, reps: int = 10) -> float:
    """Device time per call: the call's kernel durations summed from a profiler trace. For calls whose host
    dispatch outlasts their kernels (chunk attention: ~0.5 ms a dispatch, 0.15–0.2 ms of kernels for a window
    chunk) the back-to-back timer measures the host; this measures the GPU."""
    from dsjax.bench.profile import kernel_times
    times, _ = kernel_times(fn, args, reps)
    return sum(times.values())


def rel_diff(a, b) -> float:
    """max |a - b| / max |b| (tuples of outputs: over all of them)."""
    flat = lambda x: np.concatenate([np.ravel(np.asarray(y, np.float32)) for y in jax.tree.leaves(x)])  # noqa: E731
    a, b = flat(a), flat(b)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def side_by_side(emit, run, args, base: dict, nbytes: int, configs, timer=time_us, kernel_timer=None):
    """Time run("xla") and run("pallas", **config) per config on the same inputs; emit one record each, the
    Pallas ones with their difference from XLA's output. A config that fails to compile is reported, not fatal.
    kernel_timer (e.g. `device_us`): also each call's kernels alone, as `kernel_us` (the looped timer's ~5-8 µs a
    call of loop and link is no part of a model step: docs/benchmarks.md, the read ceiling on an H100)."""
    kernels = (lambda fn: {"kernel_us": kernel_timer(fn, *args)}) if kernel_timer else (lambda fn: {})  # noqa: E731
    xla_fn = run("xla")
    want = xla_fn(*args)
    t_xla = timer(xla_fn, *args)
    emit(dict(base, impl="xla", us=t_xla, bytes=nbytes, **kernels(xla_fn)))
    default = None      # the first config's output: other configs (tiles, the PTX FP4 decode) should equal it
    for opts in configs:
        try:
            fn = run("pallas", **opts)
            got = fn(*args)
            rec = dict(base, impl="pallas", options=opts, us=timer(fn, *args), bytes=nbytes,
                       rel_diff_vs_xla=rel_diff(got, want), xla_us=t_xla, **kernels(fn))
            if default is None:
                default = got
            else:
                rec["rel_diff_vs_first_config"] = rel_diff(got, default)
            emit(rec)
        except Exception as e:  # noqa: BLE001
            emit(dict(base, impl="pallas", options=opts, error=repr(e)[:500]))


# ----------------------------------------------------------------------------- sparse MQA decode attention

def mqa_case(key, B: int, N: int, picks: int | None, Q: int = 6, H: int = 64, window: int = 128):
    """CSA-style (`picks` random entries of N per query) or HCA-style (picks=None: every entry) inputs."""
    fmt = MainRowFormat()
    cfg = type("C", (), dict(nope_head_dim=fmt.nope, kv_quant_block=fmt.block, rope_head_dim=fmt.rope))
    ks = jax.random.split(key, 6)

    def rows(k, n):
        v = jax.random.normal(k, (B, n, fmt.dim), jnp.float32)
        v = jnp.concatenate([quant.fp8_e4m3_sim(v[..., :fmt.nope], fmt.block), v[..., fmt.nope:]], -1)
        return kv_rows.pack_main(v.astype(jnp.bfloat16), cfg)

    q = jax.random.normal(ks[0], (B, Q, H, fmt.dim), jnp.float32).astype(jnp.bfloat16)
    sink = jax.random.normal(ks[1], (H,), jnp.float32)
    win = rows(ks[2], window + Q)
    start = jnp.full((B,), 4 * N, jnp.int32)
    win_idx = sparse_mqa.window_indices(start, Q, window)
    comp = rows(ks[3], N)
    if picks is None:
        comp_idx = sparse_mqa.hca_indices(start[:, None] + jnp.arange(Q), N, 1)
    else:
        comp_idx = jax.random.randint(ks[4], (B, Q, picks), 0, N, jnp.int32)
    return (q, sink, win, win_idx, comp, comp_idx), fmt


def mqa_case41(key, B: int, N: int, picks: int, Q: int = 6, H: int = 64, window: int = 128):
    """V4.1 rows (spec §4.1): the window as 528-byte FP8 rows, `picks` of N compressed entries as 288-byte FP4
    rows, read in place by the kernel (`row_format` per source)."""
    import types

    from dsjax import v41_rows
    from dsjax.kernels.common import Fp4RowFormat

    d = 512
    cfg = types.SimpleNamespace(head_dim=d, family="v4.1")
    fmts = (MainRowFormat(nope=d, rope=0, block=32), Fp4RowFormat(dim=d))
    ks = jax.random.split(key, 5)
    q = jax.random.normal(ks[0], (B, Q, H, d), jnp.float32).astype(jnp.bfloat16)
    sink = jax.random.normal(ks[1], (H,), jnp.float32)
    win = v41_rows.pack_window(quant.fp8_e4m3_sim(jax.random.normal(ks[2], (B, window + Q, d), jnp.float32), 32)
                               .astype(jnp.bfloat16), cfg)
    start = jnp.full((B,), 4 * N, jnp.int32)
    comp = v41_rows.quantize_main(jax.random.normal(ks[3], (B, N, d), jnp.float32), cfg)
    comp_idx = jax.random.randint(ks[4], (B, Q, picks), 0, N, jnp.int32)
    return (q, sink, win, sparse_mqa.window_indices(start, Q, window), comp, comp_idx), fmts


def mqa_bytes(args) -> int:
    """The distinct rows each source's indices select (at that source's row width), the queries, the output."""
    q, _, win, win_idx, comp, comp_idx = args
    distinct = lambda ix: sum(len(np.unique(np.asarray(ix[b]))) for b in range(q.shape[0]))  # noqa: E731
    row = lambda rows: rows.shape[-1] * rows.dtype.itemsize  # noqa: E731
    return distinct(win_idx) * row(win) + distinct(comp_idx) * row(comp) + 2 * q.size * 2


def bench_mqa(emit, sweep: bool, smoke: bool = False):
    cases = [("csa", 2, 256, 64), ("hca", 1, 64, None)] if smoke else [
             ("csa@64k", 32, 16384, 512), ("hca@64k", 32, 512, None), ("csa@64k", 1, 16384, 512),
             ("hca@64k", 1, 512, None), ("csa@1M", 1, 262144, 512), ("hca@1M", 1, 8192, None),
             ("hca@1M", 32, 8192, None)]
    # V4.1-Flash (FP8 window rows + FP4 compressed rows): a ratio-2 CSA2 layer at 64k (32,768 entries) and the
    # ratio-1 layers at 64k / 1M (65,536 / 1,048,576 entries), 512 picks each
    cases41 = [("v41-r2@64k", 1, 64, 16)] if smoke else [("v41-r2@64k", 32, 32768, 512), ("v41-r1@64k", 1, 65536, 512),
                                                        ("v41-r1@1M", 1, 1 << 20, 512), ("v41-r1@64k", 32, 65536, 512)]
    configs = [{}]
    if sweep:
        configs += [dict(block_k=bk, head_block=hb, num_warps=w) for bk in (32, 64) for hb in (32, 64) for w in (4, 8)]
    for name, B, N, picks in cases:
        args, fmt = mqa_case(jax.random.key(0), B, N, picks)
        nbytes = mqa_bytes(args)
        run = lambda impl, **o: jax.jit(functools.partial(sparse_mqa.sparse_mqa_decode, scale=fmt.dim ** -0.5,
                                                          row_format=fmt, implementation=impl, **o))
        side_by_side(emit, run, args, dict(op="sparse_mqa", case=name, batch=B, entries=N), nbytes, configs)
    for name, B, N, picks in cases41:
        args, fmts = mqa_case41(jax.random.key(0), B, N, picks)
        run = lambda impl, **o: jax.jit(functools.partial(sparse_mqa.sparse_mqa_decode, scale=512 ** -0.5,
                                                          row_format=fmts, implementation=impl, **o))
        side_by_side(emit, run, args, dict(op="sparse_mqa", case=name, batch=B, entries=N, rows="v4.1"),
                     mqa_bytes(args), configs)


# ----------------------------------------------------------------------------- chunk (prefill) attention

def chunk_case(key, context: int, kind: str, T: int = 1024, H: int = 64, window: int = 128):
    """A chunk of T queries at positions [context - T, context) of one sequence: segments (+ picks) and the
    number of (query, key) pairs visible — the work a dense-FLOP count charges."""
    fmt = MainRowFormat()
    cfg = type("C", (), dict(nope_head_dim=fmt.nope, kv_quant_block=fmt.block, rope_head_dim=fmt.rope))
    ks = jax.random.split(key, 6)

    def rows(k, n):
        v = jax.random.normal(k, (1, n, fmt.dim), jnp.float32)
        v = jnp.concatenate([quant.fp8_e4m3_sim(v[..., :fmt.nope], fmt.block), v[..., fmt.nope:]], -1)
        return kv_rows.pack_main(v.astype(jnp.bfloat16), cfg)

    start = jnp.array([context - T], jnp.int32)
    q_pos = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    q = jax.random.normal(ks[0], (1, T, H, fmt.dim), jnp.float32).astype(jnp.bfloat16)
    sink = jax.random.normal(ks[1], (H,), jnp.float32)
    segs = [chunk_attention.window_segment(rows(ks[2], window), rows(ks[3], T), start, window)]
    pairs = T * window
    picks = None
    if kind == "hca":
        n = context // 128
        segs.append(chunk_attention.compressed_segment(rows(ks[4], n), 128))
        pairs += int(np.sum((np.asarray(q_pos[0]) + 1) // 128))
    elif kind == "csa":
        n = context // 4
        idx = jax.random.randint(ks[5], (1, T, 512), 0, n, jnp.int32)
        picks = (rows(ks[4], n), idx)
        pairs += T * 512
    return (q, q_pos, sink, segs, picks), fmt, pairs * H


def jnp_matmul_tflops() -> float:
    a = jnp.ones((8192, 8192), jnp.bfloat16)
    f = jax.jit(lambda a: a @ a)
    return 2 * 8192 ** 3 / time_us(f, a) / 1e6


def bench_chunk(emit, sweep: bool, smoke: bool = False):
    mm = None if smoke else jnp_matmul_tflops()
    emit(dict(op="matmul", impl="jnp", shape="8192^3 bf16", TFLOPs=mm))
    cases = [("hca", 2048), ("csa", 2048)] if smoke else [
        (kind, ctx) for ctx in (8192, 65536, 131072, 1 << 20) for kind in ("window", "hca", "csa")] + [
        ("hca", 1 << 18), ("hca", 1 << 19)]     # between 128k and 1M, where XLA's dense HCA path was faster until 12-05
    # the Triton kernel and the Mosaic GPU (wgmma) one; the smoke run skips the latter (its interpret mode needs
    # ≥ 3 XLA:CPU threads: tests/chunk_mosaic_worker.py)
    # (the default: no partial-score exchange, each warpgroup's whole Q·Kᵀ; and one buffer taken in turns, the
    # default until 2026-12-05; with --sweep also two buffers: one rendezvous a key tile, beside one stage of keys
    # only; the next tile's Q·Kᵀ in flight through this one's exchange; 128-key tiles in one stage: all three
    # measured slower, 2026-12-02/04/05)
    configs = [{}] + ([] if smoke else [dict(backend="mosaic"), dict(backend="mosaic", exchange_buffers=1)])
    timed_everywhere = len(configs)
    if sweep:
        configs += [dict(backend="mosaic", stages=1, exchange_buffers=2),
                    dict(backend="mosaic", exchange_buffers=1, overlap_qk=True)]
        configs += [dict(block_q=bq, block_k=bk, num_warps=w, num_stages=st) for bq, bk, w, st in (
            (64, 32, 4, 2), (64, 32, 8, 2), (64, 64, 4, 2), (64, 64, 8, 3), (128, 32, 8, 2), (128, 32, 8, 3),
            (128, 64, 8, 1), (32, 64, 4, 2))]
        # 64-key tiles in 1 stage; 128-key tiles fit SMEM in one stage only (3 stages of 64 overflow it)
        configs += [dict(backend="mosaic", stages=1), dict(backend="mosaic", block_k=128, stages=1)]
    T = 256 if smoke else 1024
    # device time (profiler) on the GPU; the back-to-back wall time beside it (`wall_us`) shows the host floor
    timer, wall = (time_us, lambda *a, **k: None) if smoke else (device_us, time_us)
    for kind, ctx in cases:
        args, fmt, pairs = chunk_case(jax.random.key(3), ctx, kind, T=T)
        q, q_pos, sink, segs, picks = args
        nbytes = sum(s.kv.nbytes for s in segs) + (picks[0].nbytes if picks else 0) + 2 * q.nbytes
        flops = 4 * pairs * fmt.dim

        def run(impl, **o):
            f = functools.partial(chunk_attention.chunk_attention, scale=fmt.dim ** -0.5, row_format=fmt,
                                  implementation=impl, **o)
            return jax.jit(lambda q, q_pos, sink, segs, picks: f(q, q_pos, sink, segs, picks))

        base = dict(op="chunk_attention", case=f"{kind}@{ctx // 1024}k", tokens=T, context=ctx, flops=flops,
                    matmul_TFLOPs_jnp=mm)
        if kind == "csa" and ctx > 131072:      # the dense-mask XLA path would score all 262k entries per query
            for opts in configs[:timed_everywhere]:
                fn = run("pallas", **opts)
                us = timer(fn, *args)
                emit(dict(base, impl="pallas", options=opts, us=us, wall_us=wall(fn, *args), bytes=nbytes,
                          TFLOPs=flops / us / 1e6, of_matmul_jnp=(flops / us / 1e6 / mm) if mm else None))
            continue
        xla_fn = run("xla")
        want = xla_fn(*args)
        t_xla = timer(xla_fn, *args)
        emit(dict(base, impl="xla", us=t_xla, wall_us=wall(xla_fn, *args, calls=5), bytes=nbytes,
                  TFLOPs=flops / t_xla / 1e6))
        for opts in (configs if kind == "hca" and ctx == 131072 else configs[:timed_everywhere]):
            try:
                fn = run("pallas", **opts)
                err = rel_diff(fn(*args), want)
                us = timer(fn, *args)
                emit(dict(base, impl="pallas", options=opts, us=us, wall_us=wall(fn, *args), bytes=nbytes,
                          TFLOPs=flops / us / 1e6,
                          of_matmul_jnp=(flops / us / 1e6 / mm) if mm else None, rel_diff_vs_xla=err, xla_us=t_xla))
            except Exception as e:  # noqa: BLE001
                emit(dict(base, impl="pallas", options=opts, error=repr(e)[:800]))


# ----------------------------------------------------------------------------- mHC split + Sinkhorn

def bench_mhc(emit, sweep: bool, smoke: bool = False):
    """The split of one sub-layer's mixes (n = 4, 20 iterations) at decode, verify and prefill row counts: the
    iterations unrolled ("reference"), the model's scan (the XLA path) and the fused kernel."""
    n, width = 4, 24
    for rows in ((1, 64) if smoke else (1, 6, 192, 2048, 16384)):
        ks = jax.random.split(jax.random.key(rows), 3)
        m = jax.random.normal(ks[0], (1, rows, width), jnp.float32)
        scale = jax.random.uniform(ks[1], (3,), jnp.float32, 0.5, 2.0)
        base = jax.random.normal(ks[2], (width,), jnp.float32)
        args = (m, scale, base)
        run = lambda impl, **o: jax.jit(functools.partial(mhc_sinkhorn.mhc_sinkhorn, n=n, iters=20, eps=1e-6,
                                                          implementation=impl, **o))
        looped = rows <= 6                  # decode / verify: device time (one call is shorter than a dispatch)
        timer, timing = (time_us_looped, "device loop") if looped else (time_us, "dispatches")
        unrolled = run("reference")
        emit(dict(op="mhc_sinkhorn", rows=rows, impl="reference (unrolled)", us=timer(unrolled, *args),
                  bytes=m.nbytes * 2, timing=timing))
        # at decode / verify (latency-bound): the old default's 256-row, 4-warp program, and a reciprocal per sum
        # instead of divides
        small = [dict(block_rows=256, num_warps=4), dict(reciprocal=True)] if looped else []
        side_by_side(emit, run, args, dict(op="mhc_sinkhorn", rows=rows, timing=timing), m.nbytes * 2,
                     [{}] + small + ([dict(block_rows=b) for b in (64, 128, 512)] if sweep and rows >= 2048 else []),
                     timer=timer)


# ----------------------------------------------------------------------------- lightning indexer

def bench_indexer(emit, sweep: bool, smoke: bool = False):
    fmt = IndexRowFormat()
    N, nh, Q, k = (1024, 64, 6, 64) if smoke else (262144, 64, 6, 512)
    for B in ((1,) if smoke else (1, 32)):
        ks = jax.random.split(jax.random.key(1), 3)
        q = quant.fp4_e2m1_sim(jax.random.normal(ks[0], (B, Q, nh, fmt.dim), jnp.float32), fmt.block)
        q = q.astype(jnp.bfloat16)
        w = (jax.random.normal(ks[1], (B, Q, nh), jnp.float32) * 0.1).astype(jnp.bfloat16)
        keys = kv_rows.pack_index(jax.random.normal(ks[2], (B, N, fmt.dim), jnp.float32).astype(jnp.bfloat16),
                                  type("C", (), dict(index_head_dim=fmt.dim, index_quant_block=fmt.block)))
        nv = jnp.full((B, Q), N, jnp.int32)
        args = (q, w, keys, nv)
        nbytes = keys.size + q.size * 2
        run = lambda impl, **o: jax.jit(functools.partial(indexer_topk.indexer_topk, k=k, row_format=fmt,
                                                          implementation=impl, **o))
        xla_fn = run("xla")
        want = xla_fn(*args)
        t_xla = time_us(xla_fn, *args, calls=5)
        emit(dict(op="indexer_topk", case="1M", batch=B, entries=N, impl="xla", us=t_xla, bytes=nbytes))
        from dsjax.kernels.indexer_topk import pallas_gpu, pallas_triton, xla as ixla
        sx = np.asarray(jax.jit(lambda *a: ixla.index_scores(*a[:3], fmt))(*args), np.float32)
        for backend, mod in (("triton", pallas_triton), ("mosaic", pallas_gpu)):
            try:   # the scores themselves: the top-k picks differ wherever bf16 scores tie
                sp = np.asarray(jax.jit(lambda *a: mod.index_scores(*a, fmt))(*args), np.float32).reshape(B, Q, -1)
                emit(dict(op="indexer_scores", backend=backend, batch=B, scores_equal_fraction=float(np.mean(sp == sx)),
                          max_abs_diff=float(np.max(np.abs(sp - sx))), scale=float(np.max(np.abs(sx)))))
                fn = run("pallas", backend=backend)
                got = fn(*args)
                same = float(np.mean(np.asarray(got[0]) == np.asarray(want[0])))
                emit(dict(op="indexer_topk", case="1M", batch=B, entries=N, impl="pallas", options={"backend": backend},
                          us=time_us(fn, *args, calls=5), bytes=nbytes, same_indices_fraction=same, xla_us=t_xla))
            except Exception as e:  # noqa: BLE001
                emit(dict(op="indexer_topk", batch=B, impl="pallas", options={"backend": backend}, error=repr(e)[:800]))


def bench_indexer_chunk(emit, sweep: bool, smoke: bool = False):
    """A prefill chunk's index scores (1,024 queries against a long context's keys, every key visible: the chunk
    that ends there): XLA (the model's path) against the Mosaic kernel at 1-8 query rows a program, keys as bf16
    values and as the 68-byte FP4 rows the cache stores; then the top-k on them: `lax.top_k` against
    `layers.radix_topk.top_k_bf16` and its options (each record says whether its indices equal the sort's).
    V4.1's 32 index heads and V4's 64 (128 dims each); TFLOP/s of 2·Q·heads·128·N against torch's matmul."""
    fmt = IndexRowFormat()
    cases = [(128, 32, 16)] if smoke else [(N, nh, 1024) for nh in (32, 64) for N in (65536, 131072)]
    for N, nh, Q in cases:
        ks = jax.random.split(jax.random.key(2), 3)
        q = quant.fp4_e2m1_sim(jax.random.normal(ks[0], (1, Q, nh, fmt.dim), jnp.float32), fmt.block)
        q = q.astype(jnp.bfloat16)
        w = (jax.random.normal(ks[1], (1, Q, nh), jnp.float32) * 0.1).astype(jnp.bfloat16)
        values = quant.fp4_e2m1_sim(jax.random.normal(ks[2], (1, N, fmt.dim), jnp.float32), fmt.block)
        rows = kv_rows.pack_index(values.astype(jnp.bfloat16),
                                  type("C", (), dict(index_head_dim=fmt.dim, index_quant_block=fmt.block)))
        nv = jnp.full((1, Q), N, jnp.int32)
        flops = 2 * Q * nh * fmt.dim * N
        for keys, kind in ((values.astype(jnp.bfloat16), "bf16"), (rows, "fp4rows")):
            run = lambda impl, **o: jax.jit(functools.partial(indexer_topk.index_scores, row_format=fmt,  # noqa: E731
                                                              implementation=impl, **o))
            configs = [{}] if smoke else [dict(rows_per_program=r) for r in (8, 4, 2, 1) if r * nh <= 256]
            side_by_side(emit, run, (q, w, keys, nv), dict(op="indexer_chunk_scores", heads=nh, queries=Q,
                                                           entries=N, keys=kind, flops=flops),
                         keys.nbytes + q.nbytes, configs)
        scores = jax.jit(lambda q, w, k, nv: indexer_topk.index_scores(q, w, k, nv, row_format=fmt))(q, w, rows, nv)
        k = min(512, N)
        sort = jax.jit(lambda s: jax.lax.top_k(s, k))
        want = sort(scores)[1]
        t_sort = time_us(sort, scores, calls=5)
        emit(dict(op="indexer_chunk_topk", heads=nh, queries=Q, entries=N, k=k, impl="lax.top_k", us=t_sort))
        for opts in ({}, dict(narrow=False), dict(one_prefix_sum=True), dict(bits_per_pass=2)):
            fn = jax.jit(lambda s, o=opts: radix_topk.top_k_bf16(s, k, **o))
            emit(dict(op="indexer_chunk_topk", heads=nh, queries=Q, entries=N, k=k, impl="radix_topk.top_k_bf16",
                      options=opts, us=time_us(fn, scores, calls=5), lax_top_k_us=t_sort,
                      same_indices=bool(jnp.all(fn(scores)[1] == want))))


# ----------------------------------------------------------------------------- MoE expert GEMM

def expert_stack(key, E, out, inn, fmt):
    """Random expert weights drawn on the device, stored as the checkpoint stores them."""
    w = jax.random.normal(key, (E, out, inn), jnp.bfloat16) * 0.02
    return stored_linear(w, fmt, 32 if fmt == "fp4" else 128)


def moe_shapes(smoke: bool) -> tuple[int, int, int, int]:
    """(experts, model dim, expert dim, picks per token): V4-Flash's, or tiny ones for a CPU check."""
    return (16, 256, 256, 6) if smoke else (256, 4096, 2048, 6)


def moe_routing(n: int, E: int, D: int, k: int):
    """Tokens x [n, D] bf16, routing weights [n, k] and k distinct experts per token, seeded by n."""
    rng = np.random.default_rng(n)
    ids = jnp.asarray(np.stack([rng.permutation(E)[:k] for _ in range(n)]), jnp.int32)
    w = jnp.asarray(rng.uniform(0.05, 0.3, (n, k)), jnp.float32)
    return jax.random.normal(jax.random.key(n), (n, D), jnp.bfloat16), w, ids


def moe_bytes(lins, n_distinct: int) -> int:
    per = sum((l.weight.nbytes + (0 if l.scale is None else l.scale.nbytes)) // l.weight.shape[0] for l in lins)
    return per * n_distinct


def bench_moe(emit, sweep: bool, smoke: bool = False, fmts=("fp4", "fp8", "bf16"), only_tokens=None, extra=(),
              activations: str = "fp8"):
    E, D, I, k = moe_shapes(smoke)
    configs = [{}]
    if sweep:
        configs += [dict(block_i=bi, block_d=bi, num_warps=w) for bi in (32, 64, 128) for w in (4, 8)]
        configs += [dict(target_programs=t) for t in (2 * 132, 32 * 132)] + [dict(num_stages=4)]
        configs += [dict(block_k=256), dict(block_k=256, num_warps=8), dict(block_i=64, block_d=64, block_k=256)]
    gemv = [dict(block_m=m) for m in (1, 2, 4)] + [dict(block_m=1, block_i=b, block_d=b) for b in (64, 128)]
    gemv += [dict(block_m=1, block_k=256), dict(block_m=1, num_warps=8), dict(block_m=2, block_i=64, block_d=64)]
    for fmt in fmts:
        ks = jax.random.split(jax.random.key(2), 3)
        lins = [expert_stack(ks[0], E, I, D, fmt), expert_stack(ks[1], E, I, D, fmt), expert_stack(ks[2], E, D, I, fmt)]
        sizes = (1, 2, 4, 8, 256, 1024, 2048) if fmt == "fp4" else (1, 8)
        sizes = sorted(set(only_tokens)) if only_tokens else (1, 8) if smoke else sizes
        for n in sizes:
            x, w, ids = moe_routing(n, E, D, k)
            args = (x, w, ids, *lins)
            nbytes = moe_bytes(lins, len(np.unique(np.asarray(ids)))) + x.nbytes * 3
            run = lambda impl, **o: jax.jit(functools.partial(  # noqa: E731
                moe_gemm.moe_gemm, swiglu_limit=10.0, act_quant_sim=activations == "fp8", act_quant_block=128,
                implementation=impl, **o))
            flops = 2 * n * k * 3 * D * I
            prefill_configs = [{}] + [dict(fp4_kernel="triton", block_m=bm, block_i=bo, block_d=bo, num_warps=w,
                                           num_stages=st)
                                      for bm, bo, w, st in ((32, 64, 4, 3), (64, 64, 4, 3), (64, 64, 8, 3),
                                                            (64, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 2),
                                                            (64, 32, 4, 3), (32, 32, 4, 3))]
            chosen = (configs + gemv if sweep and n <= 8 and fmt == "fp4" else
                      [{}] + gemv if sweep and n <= 8 else
                      prefill_configs if sweep and n >= 1024 and fmt == "fp4" else [{}])
            # beside the defaults: the path they replaced — FP4 experts, the Triton kernels (the Mosaic kernel is the
            # default on a GPU); otherwise the other operand form (FP8 activations: FP8 tensor
            # cores or bf16 operands, `FP8_MMA_DEFAULT` picks per format)
            previous = ([dict(fp4_kernel="triton")] if fmt == "fp4" else
                        [dict(fp8_mma=not moe_gemm_kernel.FP8_MMA_DEFAULT[fmt])] if fmt in ("fp4", "fp8") else [])
            looped = n <= 64                                             # decode: device time, not dispatch
            side_by_side(emit, run, args, dict(op="moe_gemm", fmt=fmt, tokens=n, activations=activations, flops=flops,
                                               timing="device loop" if looped else "dispatches"), nbytes,
                         chosen + previous + list(extra), timer=time_us_looped if looped else time_us,
                         kernel_timer=device_us if looped and not smoke else None)
        del lins


# ----------------------------------------------------------------------------- dense quantised linear

LINEAR_SHAPES = {"wq_a": (1024, 4096), "wq_b": (32768, 1024), "wkv": (512, 4096), "shared_w1": (2048, 4096)}


def bench_linear(emit, sweep: bool, smoke: bool = False):
    """V4-Flash's projections in FP8 (128x128 blocks, V4; 32x32, V4.1's format) at decode (1, 8, 32 rows) and a
    prefill chunk (1,024 rows): the stored-format kernel vs XLA's dequantise-then-matmul (issue 9: the
    dequantised copy was 11% of a decode step). Device time (`time_us_looped`): one projection alone is shorter
    than a dispatch."""
    from dsjax.kernels.quant_linear import quant_linear

    shapes = {"smoke": (128, 256)} if smoke else LINEAR_SHAPES
    configs = [{}] + ([dict(block_o=bo, num_warps=w) for bo in (32, 64, 128) for w in (4, 8)] if sweep else [])
    for block in ((128,) if smoke else (128, 32)):
        for name, (out, inn) in shapes.items():
            w = stored_linear(jax.random.normal(jax.random.key(3), (out, inn), jnp.bfloat16) * 0.02, "fp8", block)
            for n in ((1, 8) if smoke else (1, 8, 32, 1024)):
                x = jax.random.normal(jax.random.key(n), (n, inn), jnp.bfloat16)
                run = lambda impl, **o: jax.jit(functools.partial(quant_linear, act_quant_sim=True,  # noqa: E731
                                                                  act_quant_block=block, implementation=impl, **o))
                nbytes = w.weight.nbytes + w.scale.nbytes + x.nbytes + n * out * 2
                side_by_side(emit, run, (x, w), dict(op="quant_linear", weight=name, fmt=f"fp8-{block}", tokens=n,
                                                     flops=2 * n * out * inn, timing="device loop"), nbytes,
                             configs if n <= 32 else [{}], timer=time_us_looped)


def bench_head(emit, sweep: bool, smoke: bool = False):
    """The LM head at decode and verify row counts (V4.1-Flash: 129,280 x 5,120 bf16; the V4.1 slice profile's verify
    spent 20% of its kernel time in two few-row head GEMMs): `lm_head`'s fp32 dot vs its exact bf16 split. Device time."""
    V, D = (1000, 64) if smoke else (129280, 5120)
    w = (jax.random.normal(jax.random.key(5), (V, D), jnp.float32) * 0.02).astype(jnp.bfloat16)
    for n in ((1, 6) if smoke else (1, 6, 12, 32, 192, 512)):
        y = jax.random.normal(jax.random.key(n), (n, D), jnp.float32)
        want = jax.jit(functools.partial(lm_head, method="fp32"))(y, w)
        # a float64 reference over the first 2,048 vocabulary rows (on the host): which of the two is nearer exact
        cols = min(V, 2048)
        exact = np.asarray(y, np.float64) @ np.asarray(w[:cols].astype(jnp.float32), np.float64).T
        base = dict(op="lm_head", tokens=n, flops=2 * n * V * D, timing="device loop",
                    bytes=w.nbytes + y.nbytes + n * V * 4)
        for name, method in (("fp32-highest", "fp32"), ("bf16x3", "bf16x3")):
            f = jax.jit(functools.partial(lm_head, method=method))
            got = f(y, w)
            err = np.abs(np.asarray(got[:, :cols], np.float64) - exact).max() / np.abs(exact).max()
            emit(dict(base, impl=name, us=time_us_looped(f, y, w), rel_diff_vs_fp32=rel_diff(got, want),
                      rel_err_vs_f64=float(err)))


# the Pallas kernel's tuning options, read from its signature (the op's own arguments and `interpret` are not options)
MOE_OPTIONS = tuple(name for name in inspect.signature(moe_gemm_kernel.moe_gemm).parameters
                    if name not in ("x", "weights", "ids", "w1", "w3", "w2", "swiglu_limit", "act_quant_sim",
                                    "act_quant_block", "interpret"))


def token_counts(text: str) -> list[int]:
    """argparse `type` for a list of MoE token counts (this bench's --moe-tokens, moe_profile's --tokens):
    comma-separated positive integers in the order given (a clear usage error otherwise)."""
    try:
        counts = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated integers, got {text!r}") from None
    if not counts or any(c < 1 for c in counts):
        raise argparse.ArgumentTypeError(f"token counts must be positive, got {text!r}")
    return counts


def option_list(text: str, allowed) -> list[dict]:
    """argparse `type` body for a JSON list of option objects whose keys lie in `allowed` (a clear error otherwise)."""
    try:
        configs = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(configs, list) or not all(isinstance(c, dict) for c in configs):
        raise argparse.ArgumentTypeError("expected a JSON list of objects, e.g. [{\"block_m\": 1}]")
    bad = sorted({k for c in configs for k in c if k not in allowed})
    if bad:
        raise argparse.ArgumentTypeError(f"unknown option(s) {', '.join(bad)}; choose from {', '.join(allowed)}")
    return configs


def moe_option_list(text: str) -> list[dict]:
    """--moe-configs: a JSON list of option objects, each key one of `MOE_OPTIONS`."""
    return option_list(text, MOE_OPTIONS)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default="moe,mqa,indexer,indexer_chunk,chunk,mhc,linear,head",
                   help="comma-separated: moe, mqa, indexer, indexer_chunk (a prefill chunk's index scores), chunk, "
                        "mhc, linear, head")
    p.add_argument("--sweep", action="store_true", help="also time a grid of kernel block sizes")
    p.add_argument("--out", default=None, help="append JSON lines here")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (a CPU check that the script runs)")
    p.add_argument("--moe-formats", default="fp4,fp8,bf16", help="MoE expert formats to time")
    p.add_argument("--moe-tokens", default=[], type=token_counts,
                   help="MoE token counts to time, comma-separated (default: 1,2,4,8,256,1024,2048 for FP4 experts, "
                        "1,8 for the others); up to 64 tokens are timed in a device loop, more by dispatches")
    p.add_argument("--moe-activations", default="fp8", choices=("fp8", "bf16"),
                   help="MoE activations: fp8 (x and h fake-quantized per 128 columns, the reference-fp8 numerics; "
                        "the FP8 tensor-core kernels) or bf16 (the reference-bf16 numerics)")
    p.add_argument("--moe-configs", default="[]", type=moe_option_list,
                   help='extra MoE kernel options to time beside the defaults, a JSON list of objects, e.g. '
                        '\'[{"block_m": 1, "num_warps": 8}, {"block_k": 256}]\' (keys: moe_gemm\'s Pallas options)')
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    ops = ("moe", "mqa", "indexer", "indexer_chunk", "chunk", "mhc", "linear", "head")
    unknown = [op for op in args.ops.split(",") if op not in ops]
    if unknown:
        p.error(f"--ops: unknown {', '.join(unknown)}; choose from {', '.join(ops)}")
    head = run_info("kernels", argv)
    roof = torch_roofline()
    head.update(roof)
    out = open(args.out, "a") if args.out else None

    def emit(rec):
        if rec.get("flops") and rec.get("us") and not rec.get("TFLOPs"):
            rec["TFLOPs"] = rec["flops"] / rec["us"] / 1e6
        if roof.get("matmul_TFLOPs") and rec.get("TFLOPs"):
            rec["of_matmul_torch"] = rec["TFLOPs"] / roof["matmul_TFLOPs"]
        if roof.get("copy_GBps") and "bytes" in rec and "us" in rec:
            rec["GBps"] = rec["bytes"] / rec["us"] / 1e3
            rec["of_copy_bw"] = rec["GBps"] / roof["copy_GBps"]
            if rec.get("kernel_us"):
                rec["kernels_of_copy_bw"] = rec["bytes"] / rec["kernel_us"] / 1e3 / roof["copy_GBps"]
        if "xla_us" in rec and "us" in rec:
            rec["speedup_vs_xla"] = rec["xla_us"] / rec["us"]
        line = json.dumps(rec)
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    emit(head)
    moe = functools.partial(bench_moe, fmts=tuple(args.moe_formats.split(",")),
                            only_tokens=args.moe_tokens, extra=args.moe_configs, activations=args.moe_activations)
    bench = {"moe": moe, "mqa": bench_mqa, "indexer": bench_indexer, "indexer_chunk": bench_indexer_chunk,
             "chunk": bench_chunk, "mhc": bench_mhc,
             "linear": bench_linear, "head": bench_head}
    for op in args.ops.split(","):
        bench[op](emit, args.sweep, args.smoke)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
