"""dsjax.kernels.chunk_attention's Mosaic GPU kernel (backend="mosaic"): equal to the reference on fresh random
inputs in Mosaic GPU interpret mode (a subprocess: tests/chunk_mosaic_worker.py says why), with 64-key tiles
in two stages and in one (programs that walk more blocks than the pipeline has stages), bf16 and compact FP8
rows, window + HCA and window + CSA picks, one or two partial-score buffers or none (each warpgroup's whole
Q·Kᵀ), the next tile's Q·Kᵀ overlapped with this one's softmax (its CUDA lowering at V4 shapes:
test_kernel_chunk_attention.py)."""

import json
import os
import subprocess
import sys

import pytest

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
    assert len(interpreted) == 5
    for c in interpreted:
        assert c["finite"], c
        assert not c["races"], c        # e.g. a key slot refilled by TMA without a proxy fence after generic reads
        assert c["max_abs"] <= 2.0 ** -6 * c["scale"], c


def test_interpret_mode_refuses_too_few_threads_instead_of_hanging(monkeypatch):
    from test_kernel_chunk_attention import _case, _run
    monkeypatch.setenv("NPROC", "2")
    with pytest.raises(RuntimeError, match="NPROC=8"):
        _run(_case(1, 4, False, T=8, B=1), True, "pallas", backend="mosaic")
