"""What a tensor-parallel step spends in all-reduces: the collectives of its compiled program, each timed alone.

`collective_ops` reads the partitioned HLO of a compiled step (per-device shapes) and lists every collective
with its operand shapes. `time_all_reduces` runs an all-reduce of each distinct shape on the same mesh axis in an
on-device loop (one dispatch, many back-to-back all-reduces, the dispatch cost removed by differencing two loop
lengths) and sums count x time. That is the step's all-reduce time if none overlapped compute — an upper bound of
their share of the critical path (XLA may run some asynchronously).
"""

from __future__ import annotations

import re
import time
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

COLLECTIVE = re.compile(r"= (\([^=]*\)|\S+) (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
                        r"(?:-start)?\(")
ARRAY = re.compile(r"(pred|[a-z]+\d+(?:e\d+m\d+\w*)?)\[([\d,]*)\]")


def collective_ops(hlo: str) -> list[tuple[str, tuple[tuple[str, tuple[int, ...]], ...]]]:
    """(kind, ((dtype, per-device shape), ...)) for every collective of a compiled program's HLO text."""
    ops = []
    for line in hlo.splitlines():
        m = COLLECTIVE.search(line)
        if not m:
            continue
        arrays = tuple((dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in ARRAY.findall(m.group(1)))
        ops.append((m.group(2), arrays))
    return ops


HLO_DTYPES = {"pred": "bool", "bf16": "bfloat16", "f16": "float16", "f32": "float32", "f64": "float64",
              "s8": "int8", "s16": "int16", "s32": "int32", "s64": "int64", "u8": "uint8", "u16": "uint16",
              "u32": "uint32", "u64": "uint64", "f8e4m3fn": "float8_e4m3fn", "f8e5m2": "float8_e5m2"}


def _dtype(hlo_name: str):
    return jnp.dtype(HLO_DTYPES.get(hlo_name, hlo_name))


def _bytes(arrays) -> int:
    return int(sum(np.prod(shape, dtype=np.int64) * _dtype(dt).itemsize for dt, shape in arrays))


def _loop_seconds(mesh, axis: str, arrays, n: int, repeats: int = 3) -> float:
    """Best-of seconds of one dispatch running `n` dependent all-reduces of `arrays` over `axis`."""
    size = dict(zip(mesh.axis_names, mesh.axis_sizes))[axis]
    xs = [jnp.zeros((size,) + (shape or (1,)), _dtype(dt)) for dt, shape in arrays]
    xs = [jax.device_put(x, NamedSharding(mesh, P(axis))) for x in xs]

    def loop(*xs):
        return jax.lax.fori_loop(0, n, lambda i, c: tuple(jax.lax.psum(c, axis)), tuple(xs))

    f = jax.jit(jax.shard_map(loop, mesh=mesh, in_specs=(P(axis),) * len(xs), out_specs=(P(axis),) * len(xs),
                              check_vma=False))
    jax.block_until_ready(f(*xs))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*xs))
        best = min(best, time.perf_counter() - t0)
    return best


def time_all_reduces(ops, mesh, axis: str = "tp", *, n_short: int = 20, n_long: int = 220) -> dict:
    """Per distinct all-reduce of `ops`: count, bytes and µs each (timed alone on `mesh`'s `axis`); the total."""
    counts = Counter(arrays for kind, arrays in ops if kind == "all-reduce")
    rows, total_us = [], 0.0
    for arrays, count in sorted(counts.items(), key=lambda kv: -kv[1]):
        dt = _loop_seconds(mesh, axis, arrays, n_long) - _loop_seconds(mesh, axis, arrays, n_short)
        us = max(dt, 0.0) / (n_long - n_short) * 1e6
        rows.append({"arrays": [f"{d}{list(s)}" for d, s in arrays], "count": count, "bytes": _bytes(arrays),
                     "us_each": us})
        total_us += count * us
    others = Counter(kind for kind, _ in ops if kind != "all-reduce")
    return {"all_reduces": sum(counts.values()), "all_reduce_ms_per_step": total_us / 1e3, "by_shape": rows,
            "other_collectives": dict(others),
            "method": "each distinct all-reduce of the compiled step timed alone (on-device loop of "
                      f"{n_long} minus {n_short}), times its count: an upper bound if XLA overlaps some"}
