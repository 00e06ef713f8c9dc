"""Runs the Mosaic GPU chunk attention kernel in Mosaic GPU interpret mode (race detector on, uninitialised
shared memory NaN; compiled instead on a GPU) against the reference; JSON out.

Usage: NPROC=8 python tests/chunk_mosaic_worker.py SEED -> one JSON object on the last line.
Its own process because the kernel's three warpgroups are three interpreter threads that block in barrier
callbacks, and XLA:CPU runs callbacks on a pool as large as the machine's cores (NPROC overrides it): on a
2-core machine two waiting warpgroups would starve the third.
"""

from __future__ import annotations

import json
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from interpret_races import INTERPRET, races_found  # noqa: E402
from test_kernel_chunk_attention import _case, _run, _run_compiled  # noqa: E402

# (hca, compact rows, stages, chunk length, exchange buffers, next tile's Q·Kᵀ overlapped, heads, row 1's start):
# 64-key tiles (wgmma's K group for P·V); programs that walk more key blocks than there are stages make the producer
# refill freed slots (one stage over 100 tokens x 4 heads: up to 2 blocks a program; two stages over 200 tokens x 1
# head: 3); two partial-score buffers fit on the GPU beside one stage only; one buffer (the overlap case); no buffer
# (the default: each warpgroup's whole Q·Kᵀ) with one stage and with two, where the warpgroups drift apart by up to
# a stage. The last case's second row starts at 300: its programs see entries 0-63 whole (the unmasked softmax) and
# 64-99 masked, and window tiles masked
CASES = [(False, True, 1, 24, 2, False, 4, 37), (True, True, 1, 100, 2, False, 4, 37),
         (False, False, 1, 100, 0, False, 4, 37), (True, True, 2, 200, 1, True, 1, 37),
         (True, True, 2, 100, 0, False, 4, 300)]


def main(seed: int) -> list[dict]:
    out = []
    interpret = None if jax.default_backend() == "gpu" else INTERPRET    # on the H200: compiled for sm_90a
    for hca, compact, stages, T, buffers, overlap, H, start1 in CASES:
        case = _case(seed + 7, H, compact, T=T, picks=not hca, starts=(3, start1))
        t0 = time.perf_counter()
        got = np.asarray(_run(case, hca, "pallas", backend="mosaic", stages=stages, exchange_buffers=buffers,
                              overlap_qk=overlap, interpret=interpret), np.float32)
        races = races_found() if interpret else False
        want = np.asarray(_run_compiled(case, hca, "reference"), np.float32)
        name = (f"{'hca' if hca else 'csa'}-{'fp8rows' if compact else 'bf16'}-st{stages}-T{T}-x{buffers}"
                f"{'-overlap' if overlap else ''}-H{H}-from{start1}")
        out.append(dict(case=name,
                        max_abs=float(np.abs(got - want).max()), scale=float(np.abs(want).max()),
                        finite=bool(np.isfinite(got).all()), races=races, seconds=time.perf_counter() - t0))
    return out


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]))))
