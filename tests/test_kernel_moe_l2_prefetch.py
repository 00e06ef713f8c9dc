"""`moe_gemm.l2_prefetch`: the up launch's programs pulling their experts' down weights into L2
(`mosaic_prefetch_down`), and the down launch's programs pulling their own weights before they wait for the previous
kernel (`mosaic_down_prewait`). Neither may change a value (interpreted here, where a prefetch is a no-op and no
launch waits, that checks the operands' plumbing; compiled on a GPU, the real instructions); the boxes must cover
each expert's rows in bounds; and the lowering must put them where the option says."""

import jax
import numpy as np
import pytest

import test_kernel_moe_gemm
from test_kernel_moe_gemm import LIMIT, _case
from test_kernel_moe_gemm_mosaic import _tile_case

from dsjax.bench import lowered_kernels
from dsjax.kernels.moe_gemm import l2_prefetch, moe_gemm, mosaic_fp4

on_gpu = jax.default_backend() == "gpu"


def _assert_op_equals_default(seed, n, act_quant_sim, interpret, **options):
    """The Mosaic op with `options` against the op without, on one random case: finite and bit for bit equal."""
    x, weights, ids, w1, w3, w2 = _case(seed, "fp4", n)
    run = lambda **o: np.asarray(moe_gemm(x, weights, ids, w1, w3, w2, swiglu_limit=LIMIT,  # noqa: E731
                                          act_quant_sim=act_quant_sim, act_quant_block=128, implementation="pallas",
                                          interpret=interpret, fp4_kernel="mosaic", **o))
    got = run(**options)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got.view(np.uint32), run().view(np.uint32))


@pytest.mark.parametrize("M,programs", [(16384, 32), (1024, 32), (23040, 36), (1440, 36), (33, 32), (5, 8),
                                        (300, 1), (257, 2)])
def test_boxes_cover_every_row_in_bounds(M, programs):
    """V4-Flash's down words and scales (16,384 and 1,024 flat rows over 32 programs), V4.1-Flash's (23,040 and
    1,440 over 36), and uneven splits: every row of an expert lies in some program's box, every box lies inside the
    stack and is at most `BOX_ROWS` rows, as `issue` places them (the last moved back inside)."""
    share, box, n = l2_prefetch.boxes(M, programs)
    assert box <= l2_prefetch.BOX_ROWS and n * box >= share
    covered = np.zeros(M, bool)
    for p in range(programs):
        for i in range(n):
            start = min(p * share + i * box, M - box)
            assert 0 <= start and start + box <= M
            covered[start:start + box] = True
    assert covered.all()


def test_flat_rows_keep_each_expert_whole():
    """An expert's words, flat, in 16-byte multiples: the widest row that divides them; refused otherwise."""
    words = np.arange(3 * 18 * 8, dtype=np.uint32).reshape(3, 18, 8)          # 144 words an expert: 16-word rows
    flat = np.asarray(l2_prefetch.flat_rows(words))
    assert flat.shape == (3, 9, 16)
    np.testing.assert_array_equal(flat.reshape(3, -1), words.reshape(3, -1))
    assert l2_prefetch.flat_rows(np.zeros((2, 4096, 256), np.uint32)).shape == (2, 16384, 64)
    with pytest.raises(ValueError, match="16-byte rows"):
        l2_prefetch.flat_rows(np.zeros((2, 3, 2), np.uint32))


@pytest.mark.parametrize("fp8", [True, False], ids=["e4m3", "bf16"])
def test_prefetch_changes_no_value(test_seed, fp8):
    """h with the prefetch at the last step equals h without, bit for bit on the used tiles (an
    unused tile, -1, between them; both forms, whose operand lists differ by the x scales); the op with
    `mosaic_prefetch_down` equals the op without (FP8 form); and the options it cannot run with are refused."""
    codes, scales, xt, xs, experts, pw, w1, w3 = _tile_case(test_seed, fp8)
    opts = dict(block_k=256, stages=2, pair_weight=pw, swiglu_limit=LIMIT, interpret=None if on_gpu else True)
    h = np.asarray(mosaic_fp4.tile_gemm(xt, xs, experts, [w1, w3], **opts))
    used = np.asarray(experts) >= 0
    got = np.asarray(mosaic_fp4.tile_gemm(xt, xs, experts, [w1, w3], prefetch=w3, prefetch_step=1, **opts))
    np.testing.assert_array_equal(got[used].view(np.uint16), h[used].view(np.uint16))   # K = 512: step 1 is the last
    for bad in (dict(prefetch_step=2), dict(programs=3), dict(prefetch_step=1, k_splits=2)):
        with pytest.raises(ValueError, match="prefetch is a tile grid option"):
            mosaic_fp4.tile_gemm(xt, xs, experts, [w1, w3], prefetch=w3, **{**opts, **bad})

    if not fp8:
        return                  # the op's plumbing is the same in both forms: once is enough (CI time)
    _assert_op_equals_default(test_seed, 2, fp8, None if on_gpu else True, mosaic_prefetch_down=0)


@pytest.mark.parametrize("shapes,boxes", [("v4", 3), ("v41", 4)])
def test_lowers_with_a_prefetch_a_box_in_the_up_kernel(shapes, boxes):
    """At V4-Flash's and V4.1-Flash's decode shapes (one token): the up kernel issues the down stack's boxes (V4:
    two of the words' 256 rows x 256 bytes and one of the scales; V4.1: three and one), the down kernel none, and
    the default op none."""
    with_prefetch = lowered_kernels.moe_kernels(shapes, 1, dict(mosaic_prefetch_down=4))
    assert [m.count("cp.async.bulk.prefetch.tensor") for m in with_prefetch] == [boxes, 0]
    assert all("cp.async.bulk.prefetch.tensor" not in m for m in lowered_kernels.moe_kernels(shapes, 1, {}))


@pytest.mark.skipif(not on_gpu, reason="compiled kernels run only on an NVIDIA GPU")
@pytest.mark.parametrize("act_quant_sim", [True, False], ids=["fp8_act", "bf16_act"])
@pytest.mark.parametrize("n,step", [(1, 0), (2, 1), (8, 0)])
def test_prefetch_equals_the_default_on_gpu(test_seed, monkeypatch, n, step, act_quant_sim):
    """Compiled, the prefetch instructions run (TMA boxes in L2, nothing waits for them): the op's output is the
    default's, bit for bit. D = I = 512: two steps a contraction, so step 1 exists."""
    for dim in ("D", "I"):
        monkeypatch.setattr(test_kernel_moe_gemm, dim, 512)
    _assert_op_equals_default(test_seed, n, act_quant_sim, False, mosaic_prefetch_down=step)


def test_down_prewait_changes_no_value_and_refuses_what_it_cannot_run(test_seed):
    """The op with the down launch's early prefetch equals the op without, bit for bit (the up and down launches
    sharing one expert head); `tile_gemm` refuses prewait without pdl or beside the other options it cannot run
    with, and a shared head outside the tile grid."""
    _assert_op_equals_default(test_seed, 2, True, None if on_gpu else True, mosaic_down_prewait=True)
    codes, scales, xt, xs, experts, pw, w1, w3 = _tile_case(test_seed, True)
    opts = dict(block_k=256, stages=2, interpret=True)
    for bad in (dict(prewait=True), dict(prewait=True, pdl=True, prefetch=w3), dict(prewait=True, pdl=True,
                                                                                     quad_waits=True)):
        with pytest.raises(ValueError, match="prewait needs pdl"):
            mosaic_fp4.tile_gemm(xt, xs, experts, [w1], **opts, **bad)
    with pytest.raises(ValueError, match="a given head is"):
        mosaic_fp4.tile_gemm(xt, xs, experts, [w1], head=mosaic_fp4.expert_rows(experts), programs=3, **opts)


@pytest.mark.parametrize("shapes,boxes", [("v4", 2), ("v41", 3)])
def test_down_prewait_lowers_its_prefetch_before_the_wait(shapes, boxes):
    """One token, V4-Flash and V4.1-Flash shapes: only the down kernel is a programmatic dependent, and it issues its
    own rows' boxes (V4: one of the words, one of the scales; V4.1: two and one) before `griddepcontrol.wait`; the
    up kernel neither prefetches nor waits; the h codes' Triton kernel lets its dependent launch (and the default op
    has none of it)."""
    text = lowered_kernels.lower_moe(*lowered_kernels.SHAPES[shapes], 1, dict(mosaic_down_prewait=True))
    up, down = lowered_kernels.mosaic_modules(text)
    assert text.count("uses_pdl") == 1 and text.count("griddepcontrol.launch_dependents") == 1
    assert "griddepcontrol" not in lowered_kernels.lower_moe(*lowered_kernels.SHAPES[shapes], 1, {})
    assert "cp.async.bulk.prefetch.tensor" not in up and "griddepcontrol.wait" not in up
    assert down.count("cp.async.bulk.prefetch.tensor") == boxes
    assert down.index("cp.async.bulk.prefetch.tensor") < down.index("griddepcontrol.wait")


@pytest.mark.skipif(not on_gpu, reason="compiled kernels run only on an NVIDIA GPU")
@pytest.mark.parametrize("act_quant_sim", [True, False], ids=["fp8_act", "bf16_act"])
@pytest.mark.parametrize("n", [1, 2, 8])
def test_down_prewait_equals_the_default_on_gpu(test_seed, monkeypatch, n, act_quant_sim):
    """Compiled, the down launch runs as a programmatic dependent that reads its expert and prefetches before it
    waits: the op's output is the default's, bit for bit (D = I = 512, several steps a program)."""
    for dim in ("D", "I"):
        monkeypatch.setattr(test_kernel_moe_gemm, dim, 512)
    _assert_op_equals_default(test_seed, n, act_quant_sim, False, mosaic_down_prewait=True)
