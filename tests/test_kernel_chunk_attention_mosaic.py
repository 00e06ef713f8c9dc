"""dsjax.kernels.chunk_attention's Mosaic GPU kernel (backend="mosaic"): equal to the reference on fresh random
inputs in Mosaic GPU interpret mode (a subprocess: tests/chunk_mosaic_worker.py says why), with key tiles of 64
and of 16 (programs that walk more blocks than the pipeline has stages), bf16 and compact FP8 rows, window + HCA
and window + CSA picks; and it lowers for CUDA at V4 shapes (64 heads x 512, a 1,024-token chunk)."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from lower_h200 import lower_for_h200

from dsjax.kernels.chunk_attention import Segment, chunk_attention
from dsjax.kernels.common import MainRowFormat

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def interpreted(test_seed):
    env = dict(os.environ, NPROC="8",
               PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "chunk_mosaic_worker.py"), str(test_seed)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    cases = json.loads(proc.stdout.strip().splitlines()[-1])
    for c in cases:
        print(f"{c['case']}: max|Δ| {c['max_abs']:.4g} of scale {c['scale']:.3g} ({c['seconds']:.1f} s)")
    return cases


def test_matches_reference_in_interpret_mode(interpreted):
    # as the Triton kernel (test_kernel_chunk_attention): p rounded to bf16 against the running max, the bf16
    # output one ulp (2^-7) apart; the CSA partial's extra bf16 rounding (2^-9 relative) stays inside 2^-6
    assert len(interpreted) == 4
    for c in interpreted:
        assert c["finite"], c
        assert c["max_abs"] <= 2.0 ** -6 * c["scale"], c


@pytest.mark.parametrize("picks", [False, True], ids=["window+hca", "window+csa-picks"])
def test_lowers_for_h200(picks):
    """V4 shapes lower through Mosaic GPU: wgmma operands, the 220 KB of shared memory, three warpgroups."""
    fmt = MainRowFormat()
    B, T, H, N = 1, 1024, 64, 512
    S = jax.ShapeDtypeStruct
    i32 = jnp.int32

    def f(q, q_pos, sink, win, wlo, whi, ent, elo, ehi, idx):
        segs = [Segment(win, wlo, whi)] + ([] if picks else [Segment(ent, elo, ehi)])
        return chunk_attention(q, q_pos, sink, segs, (ent, idx) if picks else None, scale=0.04, row_format=fmt,
                               implementation="pallas", backend="mosaic", interpret=False)

    rows = S((B, 128 + T, fmt.row_bytes), jnp.uint8)
    text = lower_for_h200(f, S((B, T, H, fmt.dim), jnp.bfloat16), S((B, T), i32), S((H,), jnp.float32),
                          rows, S((B, 128 + T), i32), S((B, 128 + T), i32), S((B, N, fmt.row_bytes), jnp.uint8),
                          S((B, N), i32), S((B, N), i32), S((B, T, 512), i32))
    assert "mosaic_gpu" in text


def test_interpret_mode_refuses_too_few_threads_instead_of_hanging(monkeypatch):
    from test_kernel_chunk_attention import _case, _run
    monkeypatch.setenv("NPROC", "2")
    with pytest.raises(RuntimeError, match="NPROC=8"):
        _run(_case(1, 4, False, T=8, B=1), True, "pallas", backend="mosaic")
