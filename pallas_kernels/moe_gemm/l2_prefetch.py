"""The down projection's weights pulled into L2 while the up projection folds (`tile_gemm`'s prefetch; issue 8).

Why: at one decode token the up launch is bound by its programs' step (decode, wgmma, scaled sums), not by DRAM:
on the H200 its loads alone take 12.7 µs of its ~25 (docs/benchmarks.md, "The op and its read ceiling on an
H200"), so DRAM idles for half of it, and then the down launch reads its 25 MB cold. Here every up program, at one
step of its pipeline, asks the TMA unit to prefetch its share of its tile's expert's down weights and scales into L2
(`cp.async.bulk.prefetch.tensor`: no shared memory, no barrier, nothing to wait for), so the down launch can find
them there. It changes no value: the op's outputs are the same bits (interpret mode runs it as a no-op; on a GPU
`test_prefetch_equals_the_default_on_gpu`). It pays only while the prefetched bytes fit in L2 beside the up
launch's stream (50 MB on an H100 or H200): one token's six experts are 25 MB. Measured on an H100 (2026-12-07,
docs/benchmarks.md "The down weights in L2 before the down launch"): the down kernel only 1.4-1.7 µs faster at one
token (it is bound by its programs' latency chain, not DRAM), the up kernel 2.5-5 µs slower; so it is opt-in.
`issue` also serves the down launch's own rows before its programmatic wait (`tile_gemm`'s prewait: the Linears'
own flat views with the launch's row blocks as the programs), opt-in as well.

Each expert's stored words (and scale words) are viewed flat as rows of 256, 64 or 16 bytes (`flat_rows`), and
program r of the up launch's `programs` row blocks takes rows [r·c, (r + 1)·c) of its expert,
c = ⌈rows / programs⌉, as TMA boxes of at most 256 rows (a box dimension's limit); the last box is moved back
inside the stack (an overlap is read twice into L2, harmlessly)."""

import math

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from dsjax.kernels.common import fp4_words

ROW_WORDS = (64, 16, 4)   # a flat row: 256, 64 or 16 bytes (a TMA box's inner extent must be whole 16 bytes)
BOX_ROWS = 256            # a TMA box dimension's largest extent


def flat_rows(words):
    """u32 [E, ...] -> [E, M, w]: each expert's words as rows of the widest of `ROW_WORDS` that divides them."""
    E, n = words.shape[0], math.prod(words.shape[1:])
    w = next((w for w in ROW_WORDS if n % w == 0), None)
    if w is None:
        raise ValueError(f"moe_gemm l2_prefetch: an expert's {n} words are not whole 16-byte rows")
    return words.reshape(E, n // w, w)


def operands(lin) -> list:
    """The flat [E, M, w] words of an FP4 `Linear` stack's codes and scales: what the up launch prefetches."""
    if lin.fmt != "fp4":
        raise ValueError(f"moe_gemm l2_prefetch: FP4 stacks only, got {lin.fmt}")
    return [flat_rows(fp4_words(lin.weight)), flat_rows(fp4_words(lin.scale))]


def boxes(M: int, programs: int) -> tuple[int, int, int]:
    """(rows a program, rows a box, boxes a program) for M flat rows an expert shared by `programs` programs."""
    share = -(-M // programs)
    box = min(BOX_ROWS, share)
    return share, box, -(-share // box)


def issue(refs, expert, program, programs: int):
    """Prefetch program `program`'s share of `expert`'s rows of each flat [E, M, w] ref into L2 (one thread of the
    warpgroup issues each box; nothing waits for it)."""
    for ref in refs:
        M = ref.shape[1]
        share, box, n = boxes(M, programs)
        for i in range(n):
            start = jnp.minimum(program * share + i * box, M - box)
            plgpu.async_prefetch(ref.at[expert, pl.ds(start, box)])
