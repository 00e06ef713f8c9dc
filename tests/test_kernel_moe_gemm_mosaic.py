"""dsjax.kernels.moe_gemm's Mosaic GPU FP4 kernel (`mosaic_fp4`: FP4 codes moved to e4m3 in registers, one wgmma
a 32-column scale block): `tile_gemm` and the whole op against the reference on fresh random inputs in Mosaic GPU
interpret mode (the register reinterpretation replaced by the same bytes in jnp), its CUDA lowering at V4-Flash and
V4.1-Flash shapes (which runs the `inline_mgpu` register code), and on a GPU the compiled kernel (the register
path itself) against the reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import test_kernel_moe_gemm
from one_program import one_program
from test_kernel_moe_gemm import LIMIT, _case

from dsjax import quant
from dsjax.bench import lowered_kernels
from dsjax.kernels.common import dequant_weight
from dsjax.kernels.moe_gemm import moe_gemm, mosaic_fp4
from dsjax.kernels.moe_gemm import route_slots as route_slots_mod
from dsjax.layers import moe as _moe
from dsjax.weights import stored_linear

on_gpu = jax.default_backend() == "gpu"
moe_gemm_jit = functools.partial(one_program, moe_gemm)   # the op as one program: tests/one_program.py


def _tile_case(seed, fp8, E=4, K=512, n_out=128, experts=(2, -1, 0)):
    """(x values or codes, their scales or ones, the kernel's x_tiles and x_scales, experts, pair weights, w1, w3)."""
    ks = jax.random.split(jax.random.key(seed), 4)
    lin = lambda k: stored_linear(jax.random.normal(k, (E, n_out, K), jnp.float32) * 0.05, "fp4", 32)  # noqa: E731
    T, N = len(experts), mosaic_fp4.PAIRS
    x = jax.random.normal(ks[2], (T, N, K), jnp.float32).astype(jnp.bfloat16)
    codes, scales = quant.fp8_e4m3_codes(x, 128) if fp8 else (x, jnp.ones((T, N, K // 128), jnp.float32))
    pw = jax.random.uniform(ks[3], (T, N), jnp.float32, 0.1, 1.0)
    xt = mosaic_fp4.mma_columns(codes, fp8).reshape(T, N, K // 32, 32).transpose(0, 2, 1, 3)
    xs = scales.transpose(0, 2, 1) if fp8 else None
    return codes, scales, xt, xs, jnp.array(experts, jnp.int32), pw, lin(ks[0]), lin(ks[1])


def _tile_want(codes, scales, e, w1, w3, pw_t):
    """fp32 x · Wᵀ from the dequantized values (exact products, fp32 sums), then the kernel's roundings; and the
    sums of the absolute products (the scale of an accumulation error)."""
    r = lambda a: a.astype(jnp.bfloat16).astype(jnp.float32)  # noqa: E731
    xv = codes.astype(jnp.float32) * jnp.repeat(scales, 128, axis=-1)
    W1, W3 = (dequant_weight(l.weight[e], l.scale[e], "fp4", 32) for l in (w1, w3))
    g, u = (jnp.dot(xv, W.T, precision="highest") for W in (W1, W3))
    mass = jnp.dot(jnp.abs(xv), jnp.abs(W1).T, precision="highest")
    return r(g).T, r(_moe.swiglu(r(g), r(u), LIMIT) * pw_t[:, None]).T, mass.T


# The FP8 tensor cores sum each wgmma's 32 products in reduced precision (DeepSeek-V3 report §3.3.2: about 14 bits
# kept; the kernel starts every 32-column block from zero and adds the partials in fp32): bounded here by 2^-12 of
# the absolute products' sum, beside one bf16 ulp for a rounding that lands on the other side.
TENSOR_CORE_SUM = 2.0 ** -12


def _ulp_bf16(a):
    return np.exp2(np.floor(np.log2(np.maximum(np.abs(a), 1e-30))) - 7)


@pytest.mark.parametrize("fp8", [True, False], ids=["e4m3", "bf16"])
@pytest.mark.parametrize("block_k,stages,k_splits", [(256, 2, 1), (512, 1, 1), (256, 1, 2)])
def test_tile_gemm_matches_dequantized_product(test_seed, fp8, block_k, stages, k_splits):
    """Both epilogues (y; h = swiglu · routing weight) against fp32 products of the dequantized operands; an unused
    tile (-1) between two used ones; more K steps than pipeline stages and one stage; K split over two programs (their
    fp32 partials added before the epilogue: the same bounds); e4m3 codes (FP8 tensor cores)
    and bf16 values (bf16 ones, the FP4 values' bits times 2^-126: subnormals for ±0.5). y: within one bf16 ulp
    plus `TENSOR_CORE_SUM` of its absolute products (interpreted: the same products in fp32, so one ulp). h
    (through round(g), round(u), silu and the product): within 2^-6 of its largest value."""
    codes, scales, xt, xs, experts, pw, w1, w3 = _tile_case(test_seed, fp8)
    interp = None if on_gpu else True
    opts = dict(block_k=block_k, stages=stages, k_splits=k_splits, interpret=interp)
    y = mosaic_fp4.tile_gemm(xt, xs, experts, [w1], **opts)
    h = mosaic_fp4.tile_gemm(xt, xs, experts, [w1, w3], pair_weight=pw, swiglu_limit=LIMIT, **opts)
    assert y.shape == h.shape == (3, 128, mosaic_fp4.PAIRS) and y.dtype == jnp.bfloat16
    worst = 0.0
    for t in (0, 2):
        want_y, want_h, mass = (np.asarray(a) for a in _tile_want(codes[t], scales[t], int(experts[t]), w1, w3,
                                                                     pw[t]))
        got_y, got_h = np.asarray(y[t], np.float32), np.asarray(h[t], np.float32)
        assert np.isfinite(got_y).all() and np.isfinite(got_h).all()
        excess = np.abs(got_y - want_y) - _ulp_bf16(np.maximum(np.abs(got_y), np.abs(want_y)))
        worst = max(worst, float((excess / mass).max()))
        assert (excess <= TENSOR_CORE_SUM * mass).all(), float((excess / mass).max())
        assert np.abs(got_h - want_h).max() <= 2.0 ** -6 * np.abs(want_h).max()
    print(f"y beyond one bf16 ulp: at most {worst:.3g} of the absolute products' sum")


def test_one_linear_reads_no_pair_weights(test_seed, monkeypatch):
    """The down launch (one Linear) carries the up launch's pair weights unread, so the op makes no [T, N] of zeros
    for it (a kernel launch of its own on the GPU): y with random pair weights equals y without, bit for bit, on
    the used tiles (interpreted on CPU; compiled on a GPU); the op hands both launches the routing's pair weights
    (traced only); and a pair weight of the wrong shape is refused."""
    codes, scales, xt, xs, experts, pw, w1, _ = _tile_case(test_seed, True)
    opts = dict(block_k=256, stages=2, interpret=None if on_gpu else True)
    y = mosaic_fp4.tile_gemm(xt, xs, experts, [w1], **opts)
    y_pw = mosaic_fp4.tile_gemm(xt, xs, experts, [w1], pair_weight=pw, **opts)
    used = np.asarray(experts) >= 0
    np.testing.assert_array_equal(np.asarray(y_pw)[used], np.asarray(y)[used])
    with pytest.raises(ValueError, match="pair_weight must be"):
        mosaic_fp4.tile_gemm(xt, xs, experts, [w1], pair_weight=pw[:, :4], **opts)

    seen = []
    tile_gemm = mosaic_fp4.tile_gemm
    monkeypatch.setattr(mosaic_fp4, "tile_gemm",
                        lambda *a, **o: seen.append(o.get("pair_weight")) or tile_gemm(*a, **o))
    x, weights, ids, w1, w3, w2 = _case(test_seed, "fp4", 8)
    jax.eval_shape(lambda x, weights, ids: moe_gemm(
        x, weights, ids, w1, w3, w2, swiglu_limit=LIMIT, act_quant_sim=True, act_quant_block=128,
        implementation="pallas", interpret=True, fp4_kernel="mosaic"), x, weights, ids)
    assert len(seen) == 2 and seen[0] is not None and seen[1] is seen[0]


def test_routing_head_serves_both_launches(test_seed, monkeypatch):
    """`mosaic_route_head`: the kernels' 16-byte expert rows from the routing (`Slots.head`; `route_slots` writes
    them, one row longer), so no pad kernel runs before the GEMMs. A given head with a row past T gives the outputs
    of the head made inside, bit for bit on the used tiles (interpreted on CPU; compiled on a GPU); a head of the
    wrong dtype, width or too few rows, or beside a form that makes its own, is refused; with the option the op
    hands both launches the routing's one head, from the routing program at 8 tokens and from XLA's map at one,
    by default too (timed on an H100, 2026-12-07), and with the option off none (traced only)."""
    codes, scales, xt, xs, experts, pw, w1, _ = _tile_case(test_seed, True)
    opts = dict(block_k=256, stages=2, interpret=None if on_gpu else True)
    head = jnp.concatenate([mosaic_fp4.expert_rows(experts), jnp.array([[5, 1, 2, 3]], jnp.int32)])
    y = mosaic_fp4.tile_gemm(xt, xs, experts, [w1], **opts)
    y_head = mosaic_fp4.tile_gemm(xt, xs, experts, [w1], head=head, **opts)
    used = np.asarray(experts) >= 0
    np.testing.assert_array_equal(np.asarray(y_head)[used], np.asarray(y)[used])
    for bad in (head.astype(jnp.float32), head[:, :2], head[:experts.shape[0] - 1]):
        with pytest.raises(ValueError, match="a given head is"):
            mosaic_fp4.tile_gemm(xt, xs, experts, [w1], head=bad, **opts)
    with pytest.raises(ValueError, match="a given head is"):
        mosaic_fp4.tile_gemm(xt, xs, experts, [w1], head=head, quad_waits=True, **opts)

    tile_gemm, routes = mosaic_fp4.tile_gemm, (route_slots_mod.route_slots_xla, route_slots_mod.route_slots)
    for n, program, option in ((8, True, True), (1, False, True), (8, True, False), (8, True, None)):
        seen, routed = [], []
        monkeypatch.setattr(mosaic_fp4, "tile_gemm", lambda *a, **o: seen.append(o.get("head")) or tile_gemm(*a, **o))
        route = routes[program]
        monkeypatch.setattr(route_slots_mod, route.__name__,
                            lambda *a, **o: routed.append(route(*a, **o)) or routed[-1])
        x, weights, ids, w1_, w3_, w2_ = _case(test_seed, "fp4", n)
        jax.eval_shape(lambda x, weights, ids: moe_gemm(
            x, weights, ids, w1_, w3_, w2_, swiglu_limit=LIMIT, act_quant_sim=True, act_quant_block=128,
            implementation="pallas", interpret=True, fp4_kernel="mosaic",
            **({} if option is None else dict(mosaic_route_head=option))), x, weights, ids)
        assert len(routed) == 1 and len(seen) == 2, n
        if option is False:
            assert routed[0].head is None and seen == [None, None]
            continue
        assert seen[0] is routed[0].head and seen[1] is seen[0], n
        assert routed[0].head.shape == (ids.size + program, 4)   # the program's spare row


@pytest.mark.parametrize("fp8,block_k,programs", [(False, 512, 0), (True, 256, 3)],
                         ids=["bf16-4quads-grid", "e4m3-2quads-persistent"])
def test_quad_waits_equal_the_step_form(test_seed, fp8, block_k, programs):
    """`quad_waits` (a step's blocks decoded, multiplied, waited for and summed a quad at a time) folds the same
    products in the same order as the whole-step form: bit for bit, both epilogues, 2 and 4 quads a step, in the
    tile grid and the persistent launch (interpreted on CPU; compiled on a GPU)."""
    _assert_tile_gemm_forms_equal(test_seed, fp8, dict(block_k=block_k, stages=2, programs=programs),
                                  dict(quad_waits=True))


@pytest.mark.parametrize("fp8,block_k,k_splits,quads", [(True, 256, 1, True), (True, 256, 2, False),
                                                         (False, 512, 1, False)],
                         ids=["e4m3-2steps-a-block-quads", "e4m3-split2-mid-block", "bf16-1step-a-block"])
def test_streamed_scales_equal_whole_k_scales(test_seed, fp8, block_k, k_splits, quads):
    """`stream_scales` (the rows' block scales streamed beside the weights, a block of 4 words a step or two) feeds
    each quad the same scale words as the whole-K buffer: bit for bit, both epilogues, a block shared by two steps
    (256 columns a step) or one a step (512), K split (the second split starting mid-block), with `quad_waits`."""
    _assert_tile_gemm_forms_equal(test_seed, fp8, dict(block_k=block_k, stages=2, k_splits=k_splits,
                                                       quad_waits=quads), dict(stream_scales=True))


@pytest.mark.parametrize("fp8,k_splits,quads", [(True, 2, False), (False, 1, True)],
                         ids=["e4m3-split2", "bf16-quads"])
def test_consumer_warpgroups_equal_the_tile_grid(test_seed, fp8, k_splits, quads):
    """`consumers=2` (programs of 128 rows: a compute warpgroup a 64-row block on one warp-specialized load
    pipeline, the loads issued by a memory warpgroup) folds each 64-row block as the tile grid's program does: bit
    for bit on every used tile, both epilogues, K split, with `quad_waits`; unused tiles first, between and last."""
    _assert_tile_gemm_forms_equal(test_seed, fp8, dict(block_k=256, stages=2, k_splits=k_splits, quad_waits=quads),
                                  dict(consumers=2))


def test_consumer_warpgroups_refuse_what_they_cannot_run():
    """Programs of consumers x 64 rows need n_out a multiple of that, and the tile grid; 4 consumers hung an H100
    (2026-12-06), so only 1 and 2 (`CONSUMERS`, both run on a GPU) are taken."""
    codes, scales, xt, xs, experts, pw, w1, w3 = _tile_case(0, True)
    for consumers in (0, 4):
        with pytest.raises(ValueError, match=f"consumers {consumers} must be one of"):
            mosaic_fp4.tile_gemm(xt, xs, experts, [w1], consumers=consumers, interpret=True)
    with pytest.raises(ValueError, match="consumers 2 must be one of"):
        mosaic_fp4.tile_gemm(xt, xs, experts, [w1], consumers=2, stream_scales=True, interpret=True)
    with pytest.raises(ValueError, match="tile grid options"):
        mosaic_fp4.tile_gemm(xt, xs, experts, [w1], consumers=2, programs=2, interpret=True)


def test_streamed_scales_refuse_what_they_cannot_stream():
    """V4.1-Flash's down contraction (2304 / 128 = 18 scale words a row: not 16-byte rows) and the persistent
    launch keep the whole-K buffer; asked to stream there, `tile_gemm` says so."""
    assert mosaic_fp4.streams_scales(4096, 256) and mosaic_fp4.streams_scales(5120, 512)
    assert not mosaic_fp4.streams_scales(2304, 256) and not mosaic_fp4.streams_scales(768, 768)
    codes, scales, xt, xs, experts, pw, w1, w3 = _tile_case(0, True)
    with pytest.raises(ValueError, match="tile grid options"):
        mosaic_fp4.tile_gemm(xt, xs, experts, [w1], programs=2, stream_scales=True, interpret=True)
    with pytest.raises(ValueError, match="stream_scales needs K"):
        mosaic_fp4.tile_gemm(xt[:, :8], xs[:, :2], experts, [w1], block_k=256, stream_scales=True,
                             interpret=True)


@pytest.mark.parametrize("fp8,k_splits,programs,stages", [
    (True, 1, 3, 2), (True, 2, 1, 3), (True, 1, 64, 2), (False, 2, 4, 2)],
    ids=["e4m3-3prog", "e4m3-split2-1prog", "e4m3-64prog", "bf16-split2-4prog"])
def test_persistent_launch_equals_tile_grid(test_seed, fp8, k_splits, programs, stages):
    """The persistent launch (`programs`: each program streams whole units through one pipeline) against the tile
    grid, bit for bit on every used tile: both fold a unit's K in the same order. Unused tiles (-1) first, between
    and last; one program running every unit (its accumulators reset, its side operands double-buffered across
    units of different tiles and experts), programs with one unit, more programs than units (some idle), K split
    (fp32 partials), both epilogues."""
    _assert_tile_gemm_forms_equal(test_seed, fp8, dict(block_k=256, stages=stages, k_splits=k_splits),
                                  dict(programs=programs))


def _assert_tile_gemm_forms_equal(seed, fp8, opts, variant):
    """`tile_gemm` with `opts` and with `opts` + `variant`, bit for bit on every used tile, both epilogues; unused
    tiles (-1) first, between and last."""
    codes, scales, xt, xs, experts, pw, w1, w3 = _tile_case(seed, fp8, experts=(-1, 2, 0, -1, 3, 1, -1))
    opts = dict(opts, interpret=None if on_gpu else True)
    used = np.asarray(experts) >= 0
    for lins, extra in (([w1], {}), ([w1, w3], dict(pair_weight=pw, swiglu_limit=LIMIT))):
        base = mosaic_fp4.tile_gemm(xt, xs, experts, lins, **opts, **extra)
        other = mosaic_fp4.tile_gemm(xt, xs, experts, lins, **opts, **variant, **extra)
        a, b = (np.asarray(v, np.float32)[used] for v in (base, other))
        assert np.isfinite(a).all() and np.abs(a).max() > 0
        np.testing.assert_array_equal(b.view(np.uint32), a.view(np.uint32))


def test_used_tiles_lists_used_tiles_first_with_their_count():
    from dsjax.kernels.moe_gemm.mosaic_fp4_persistent import used_tiles

    got = np.asarray(used_tiles(jnp.array([-1, 5, 0, -1, 7], jnp.int32)))
    assert got.shape == (6, 4)
    assert got[:3, :2].tolist() == [[5, 1], [0, 2], [7, 4]] and got[5, 0] == 3
    assert np.asarray(used_tiles(jnp.full((3,), -1, jnp.int32)))[3, 0] == 0


@pytest.mark.parametrize("K", [4096, 2048, 5120, 2304])      # V4-Flash's and V4.1-Flash's up and down contractions
def test_side_buffers_start_on_128_bytes(K):
    """Each unit's side operands land by tensor-map copy (`cp.async.bulk.tensor` in the PTX; its shared-memory
    destination must start on 128 bytes) in the part of a two-unit buffer its parity picks. The first version, whose
    8 pair weights a unit put the second part 32 bytes in, stopped on an H100 with a misaligned address, which
    interpret mode cannot see; with every part on 128 bytes (`mosaic_fp4_persistent.aligned`) it runs, clean under
    compute-sanitizer. This keeps that for every K of V4-Flash and V4.1-Flash (18 x-scale rows at V4.1's 2304) and
    tile width; and for the tile grid's one side buffer with quad_waits or stream_scales (`side_layout`: the x
    scales' rows, the pair weights' row, the tile expert's row; one or two KB of shared memory less a program than
    three buffers of whole KB)."""
    from dsjax.kernels.moe_gemm.mosaic_fp4_persistent import side_buffers

    Q = K // mosaic_fp4.QUAD
    for N in (8, 16, 32):
        for fp8 in (True, False):
            buffers = side_buffers(fp8, Q, N, 2)
            for (shape, dtype), copied in zip(buffers, [Q * N * 4 if fp8 else 0, N * 4, 4 * Q * 16 * 4]):
                part = int(np.prod(shape[1:])) * jnp.dtype(dtype).itemsize   # one copy's part: its stride, bytes
                assert part % 128 == 0 and part >= copied, (shape, N, fp8)
            pw_row, e_row, rows = mosaic_fp4.side_layout(Q if fp8 else 1, N)    # the tile grid's one buffer
            assert all(row * N * 4 % 128 == 0 for row in (pw_row, e_row)), (N, fp8)
            assert (Q if fp8 else 1) <= pw_row < e_row < rows, (N, fp8)


def test_scale_bytes_decode_as_e8m0():
    """The kernel's shift-and-max decode of a ue8m0 byte equals `e8m0_to_f32` for all 256 bytes (0: 2^-127)."""
    from dsjax.kernels.common import e8m0_to_f32
    u = jnp.arange(256, dtype=jnp.uint32)
    got, want = mosaic_fp4.scale_byte_f32(u), e8m0_to_f32(u.astype(jnp.uint8))
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32))
    assert float(got[0]) == 2.0 ** -127 and float(got[127]) == 1.0


def test_mma_columns_is_a_permutation_within_32_column_blocks():
    x = jnp.arange(2 * 96).reshape(2, 96)
    p = np.asarray(mosaic_fp4.mma_columns(x))
    for b in range(3):
        assert sorted(p[0, 32 * b:32 * b + 32]) == list(range(32 * b, 32 * b + 32))
    assert p[0, 16 + 4 * 3 + 2] == 8 * 3 + 2 * 2 + 1          # position 16h + 4t + i takes column 8t + 2i + h


def _check_mosaic(got, want):
    """`test_kernel_moe_gemm._check`'s bound (2^-7 of the largest output: one bf16 flip of one term, through the
    down projection and the sum over experts) doubled: the tensor cores' 32-term sums (`TENSOR_CORE_SUM`) make
    such flips a few times likelier, in g, u, h and y alike (H200: up to 0.76% of the largest output at 16
    tokens of V4-Flash shapes, against 0.78% for `_check`)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape
    err = np.abs(got - want).max() / np.abs(want).max()
    print(f"max |Δ| {err:.3g} of the largest output")
    assert err <= 2.0 ** -6


@pytest.mark.parametrize("act_quant_sim", [True, False], ids=["fp8_act", "bf16_act"])
@pytest.mark.parametrize("n,k_splits,pairs,scatter,route,programs", [
    (1, 1, 8, False, False, 0), (8, 1, 8, False, False, 0), (1, (2, 1), 8, False, False, 0),
    (8, 1, 16, True, False, 0),
    (8, 1, 8, False, None, 0), (8, 2, 8, False, False, 7)])   # None: the default, `route_slots` from 2 tokens
def test_op_matches_reference(test_seed, monkeypatch, n, k_splits, pairs, scatter, route, programs, act_quant_sim):
    """The whole op through `fp4_kernel="mosaic"` (pairs, tiles of 8 or 16, x and h codes in the kernel's column
    order, the slots gathered back by compares or — prefill sizes, forced here — by a scatter; K split over two
    programs where asked, (2, 1) the up GEMM's only; the slots from `route_slots` where the case leaves the choice
    to the op (its default at 8 tokens, checked to run); the persistent launch of 7 programs where asked)
    against the reference: duplicate experts across tokens, picks held by another shard, a token with no local
    expert (`test_kernel_moe_gemm._case`). A split case runs D = I = 512 (two steps a contraction: at 256 a split
    has nothing to split, and the op quietly runs 1), and checks which splits each GEMM ran."""
    if scatter:
        monkeypatch.setattr(route_slots_mod, "SCATTER_PAIRS", 0)
    ran = []
    if k_splits != 1:
        for dim in ("D", "I"):
            monkeypatch.setattr(test_kernel_moe_gemm, dim, 512)
        tile_gemm = mosaic_fp4.tile_gemm
        monkeypatch.setattr(mosaic_fp4, "tile_gemm", lambda *a, **o: ran.append(o["k_splits"]) or tile_gemm(*a, **o))
    if route is None:
        program = route_slots_mod.route_slots
        monkeypatch.setattr(route_slots_mod, "route_slots", lambda *a, **o: ran.append("route") or program(*a, **o))
    x, weights, ids, w1, w3, w2 = _case(test_seed, "fp4", n)
    run = lambda impl, **o: np.asarray(moe_gemm_jit(x, weights, ids, w1, w3, w2, swiglu_limit=LIMIT,  # noqa: E731
                                                    act_quant_sim=act_quant_sim, act_quant_block=128,
                                                    implementation=impl, **o))
    got = run("pallas", interpret=None if on_gpu else True, fp4_kernel="mosaic", mosaic_k_splits=k_splits,
              mosaic_pairs=pairs, mosaic_route_kernel=route, mosaic_programs=programs)
    splits = list(mosaic_fp4.gemm_splits(k_splits)) if k_splits != 1 else []
    assert ran == (["route"] if route is None else []) + splits       # the routing program, then up and down
    assert np.isfinite(got).all()
    _check_mosaic(got, run("reference"))


def test_refuses_what_it_cannot_run(test_seed):
    x, weights, ids, w1, w3, w2 = _case(test_seed, "fp4", 1)
    f8 = _case(test_seed, "fp8", 1)
    with pytest.raises(ValueError, match="FP4 experts with 32-column scale blocks"):
        moe_gemm(*f8, swiglu_limit=LIMIT, act_quant_sim=True, act_quant_block=128, implementation="pallas",
                 interpret=True, fp4_kernel="mosaic")
    codes, scales, xt, xs, experts, pw, w1_, _ = _tile_case(test_seed, True)
    with pytest.raises(ValueError, match="k_splits 3 must divide"):
        mosaic_fp4.tile_gemm(xt, xs, experts, [w1_], k_splits=3, interpret=True)
    with pytest.raises(ValueError, match="an \\(up, down\\) pair"):
        moe_gemm(x, weights, ids, w1, w3, w2, swiglu_limit=LIMIT, act_quant_sim=True, act_quant_block=128,
                 implementation="pallas", interpret=True, fp4_kernel="mosaic", mosaic_k_splits=(2, 0))
    with pytest.raises(ValueError, match="fp4_kernel"):
        moe_gemm(x, weights, ids, w1, w3, w2, swiglu_limit=LIMIT, act_quant_sim=True, act_quant_block=128,
                 implementation="pallas", interpret=True, fp4_kernel="cuda")
    with pytest.raises(ValueError, match="pairs a tile must be a multiple of 8"):
        moe_gemm(x, weights, ids, w1, w3, w2, swiglu_limit=LIMIT, act_quant_sim=True, act_quant_block=128,
                 implementation="pallas", interpret=True, fp4_kernel="mosaic", mosaic_pairs=12)


def test_default_takes_it_only_where_its_shapes_apply(test_seed):
    """`fp4_kernel`'s default: compiled on a GPU at decode and verify sizes, where every contraction is whole
    256-column steps. The tiny model's 128-wide experts are not (on the H200 its MoE layer failed at trace time
    before `applies` asked): they keep the Triton kernels, as do prefill batches and interpret mode."""
    from dsjax.kernels.moe_gemm.pallas_triton import default_fp4_kernel

    _, _, _, w1, _, w2 = _case(test_seed, "fp4", 1)
    assert w1.weight.shape[2] * 2 % 256 == 0 and w2.weight.shape[2] * 2 % 256 == 0
    assert default_fp4_kernel(w1, w2, 256, compiled_on_gpu=True) == "mosaic"
    assert default_fp4_kernel(w1, w2, 256, compiled_on_gpu=False) == "triton"
    import dsjax

    cfg = dsjax.preset("tiny-v4")
    ffn = dsjax.load("tiny-v4", max_seq_len=16, max_batch=1).params.layers[cfg.n_hash_layers].ffn
    tw1, tw2 = ffn.w1, ffn.w2
    assert tw1.fmt == "fp4" and tw1.weight.shape[2] * 2 == cfg.dim == 128
    assert not mosaic_fp4.applies(tw1, tw2, 256)
    assert default_fp4_kernel(tw1, tw2, 256, compiled_on_gpu=True) == "triton"


def test_default_tile_width_follows_an_experts_mean_share():
    """Tiles of 8 pairs up to 8 pairs an expert (the H200's decode and verify sizes), then 16, then 32: at 1,024
    tokens of top-6 over 256 experts (24 an expert) 32-pair tiles beat 24 by 15% in the FP8 form (2026-12-04)."""
    widths = {t: mosaic_fp4.default_options(6 * t, 256)["pairs"] for t in (1, 8, 256, 341, 342, 600, 682, 683, 1024,
                                                                             4096)}
    assert widths == {1: 8, 8: 8, 256: 8, 341: 8, 342: 16, 600: 16, 682: 16, 683: 32, 1024: 32, 4096: 32}
    assert mosaic_fp4.default_options(6 * 1024, 384) == dict(stages=2, pairs=16)


@pytest.mark.parametrize("E,D,I,n,act_quant_sim,k_splits,pairs,route,programs", [
    (256, 4096, 2048, 1, True, 1, None, False, 0), (256, 4096, 2048, 8, True, 1, None, False, 0),
    (256, 4096, 2048, 8, True, 1, None, False, "early+pdl"), (384, 5120, 2304, 6, False, 1, None, False, "quads"),
    (384, 5120, 2304, 6, True, 1, None, False, 0), (256, 4096, 2048, 8, False, 1, None, False, 0),
    (384, 5120, 2304, 6, False, 1, None, False, 0), (256, 4096, 2048, 1, False, 2, None, False, 0),
    (256, 4096, 2048, 1024, True, 1, 32, False, 0), (256, 4096, 2048, 1024, False, 1, 64, False, 0),
    (256, 4096, 2048, 8, True, 1, None, True, 0), (256, 4096, 2048, 8, True, 1, None, False, 132),
    (384, 5120, 2304, 6, False, 2, None, False, 132), (256, 4096, 2048, 8, True, 1, None, False, "stream"),
    (384, 5120, 2304, 6, True, 1, None, False, "stream"), (256, 4096, 2048, 8, True, 1, None, False, "quads")])
def test_lowers_for_h200(E, D, I, n, act_quant_sim, k_splits, pairs, route, programs):
    """V4-Flash (decode, 8 tokens; prefill, 1,024) and V4.1-Flash (verify) shapes: the Pallas + Mosaic GPU lowering,
    including the `inline_mgpu` code that reinterprets the words as wgmma A registers and loads the scale columns;
    one Mosaic kernel a GEMM (PTX and the cubin come at XLA compile time, on the GPU); K split over two programs;
    wide tiles (32 and 64 pairs: wgmma's N); the slots from `route_slots` (a third Triton launch); the persistent
    launch (132 programs, 4 stages); each block's sum as soon as its wgmma is done and the launch as a
    programmatic dependent ("early+pdl": `wgmma_accumulator_load` with wait_n, `griddepcontrol.wait`); a step a
    quad at a time ("quads": the words sliced in registers, a quad decoded and multiplied at a time); with the
    scales streamed ("stream": V4.1's down GEMM, 18 words a row, keeps its whole-K buffer)."""
    mode = programs if isinstance(programs, str) else ""
    early, stream = programs == "early+pdl", programs == "stream"
    quads = programs in ("quads", "stream")
    programs = 0 if early or quads else programs
    text = lowered_kernels.lower_moe(E, D, I, n, dict(
        mosaic_k_splits=k_splits, mosaic_pairs=pairs, mosaic_route_kernel=route, mosaic_programs=programs,
        mosaic_stages=4 if programs else None, mosaic_early_sums=early, mosaic_pdl=early, mosaic_quad_waits=quads,
        mosaic_stream_scales=stream), act_quant_sim)
    assert text.count("mosaic_gpu") >= 2
    assert text.count("__gpu$xla.gpu.triton") == 2 + route and "moe_tile_operands" in text   # x's and h's A tiles
    assert ("moe_route_slots" in text) == route
    assert text.count("uses_pdl") == (2 if early else 0) and ("griddepcontrol.wait" in text) == early
    assert (text.count("wgmma.wait_group") > 16) == early           # a wait a block, with its wait_n
    if (E, n, act_quant_sim, k_splits, pairs, route, programs) == (256, 8, True, 1, None, False, 0):
        # the up kernel's shared memory a program at V4-Flash decode (ncu on an H100 read the default's 57.40 KB
        # and 3 programs an SM): 4 with quad_waits (its 92 registers allow 5), 5 with the scales streamed too
        up = lowered_kernels.launch_smem_bytes(lowered_kernels.mosaic_modules(text)[0])
        want = {"stream": 5, "quads": 4}.get(mode, 3)
        assert lowered_kernels.programs_per_sm_by_smem(up) == want, (mode, up)


@pytest.mark.skipif(not on_gpu, reason="compiled kernels run only on an NVIDIA GPU")
@pytest.mark.parametrize("act_quant_sim", [True, False], ids=["fp8_act", "bf16_act"])
@pytest.mark.parametrize("n,pairs,route,programs", [(1, None, False, 0), (8, None, False, 0), (40, None, False, 0),
                                                    (400, 32, False, 0), (1, None, True, 0), (8, None, True, 0),
                                                    (1, None, False, 132), (8, None, False, 132),
                                                    (40, None, False, 132)])  # 400: the scatter unsort
def test_compiled_matches_triton_kernels_and_reference_on_gpu(test_seed, n, pairs, route, programs, act_quant_sim):
    """Compiled (the register path: `_register_blocks`, `_scale_column_mgpu`, wgmma; the persistent launch's
    double-buffered side operands and reused output tile): the Mosaic op equals the reference and the Triton
    kernels within `_check_mosaic`'s bound, and the persistent launch equals the tile grid bit for bit."""
    x, weights, ids, w1, w3, w2 = case = _case(test_seed, "fp4", n)
    run = lambda impl, **o: np.asarray(moe_gemm(x, weights, ids, w1, w3, w2, swiglu_limit=LIMIT,  # noqa: E731
                                                act_quant_sim=act_quant_sim, act_quant_block=128,
                                                implementation=impl, **o))
    got = run("pallas", interpret=False, fp4_kernel="mosaic", mosaic_pairs=pairs, mosaic_route_kernel=route,
              mosaic_programs=programs, mosaic_stages=4 if programs else None)
    assert np.isfinite(got).all()
    if programs:
        grid = run("pallas", interpret=False, fp4_kernel="mosaic", mosaic_pairs=pairs, mosaic_stages=4)
        np.testing.assert_array_equal(got.view(np.uint32), grid.view(np.uint32))
    _check_mosaic(got, run("reference"))
    _check_mosaic(got, run("pallas", interpret=False, fp4_kernel="triton"))
    del case


@pytest.mark.skipif(not on_gpu, reason="compiled kernels run only on an NVIDIA GPU")
@pytest.mark.parametrize("act_quant_sim", [True, False], ids=["fp8_act", "bf16_act"])
@pytest.mark.parametrize("n,early,pdl,quads,stream", [
    (1, True, False, False, False), (8, True, False, False, False), (40, True, True, False, False),
    (1, False, True, False, False), (8, True, True, False, False), (1, False, False, True, False),
    (8, False, False, True, False), (1, False, False, True, True), (8, False, False, True, True),
    (40, False, False, False, True)])
def test_early_sums_and_pdl_equal_the_default_on_gpu(test_seed, n, early, pdl, quads, stream, act_quant_sim):
    """`fold_early` and `fold_by_quad` do the same fp32 products and sums in the same order as `fold`, streamed
    scales are the same words, and the programmatic launch only moves when the programs start: each must leave the
    op's output unchanged, bit for bit."""
    x, weights, ids, w1, w3, w2 = _case(test_seed, "fp4", n)
    run = lambda **o: np.asarray(moe_gemm(x, weights, ids, w1, w3, w2, swiglu_limit=LIMIT,  # noqa: E731
                                          act_quant_sim=act_quant_sim, act_quant_block=128, implementation="pallas",
                                          interpret=False, fp4_kernel="mosaic", **o))
    got = run(mosaic_early_sums=early, mosaic_pdl=pdl, mosaic_quad_waits=quads, mosaic_stream_scales=stream)
    np.testing.assert_array_equal(got.view(np.uint32), run().view(np.uint32))


@pytest.mark.skipif(not on_gpu, reason="compiled kernels run only on an NVIDIA GPU")
@pytest.mark.parametrize("act_quant_sim", [True, False], ids=["fp8_act", "bf16_act"])
@pytest.mark.parametrize("n,consumers,quads,stages", [(1, 2, False, 2), (8, 2, False, 4), (40, 2, True, 2)])
def test_consumer_warpgroups_equal_the_default_on_gpu(test_seed, n, consumers, quads, stages, act_quant_sim):
    """Compiled, the warp-specialized programs (`mosaic_consumers`: a memory warpgroup issuing the loads, a compute
    warpgroup a 64-row block, the compute warpgroups' registers raised by `setmaxnreg`) fold each block as the tile
    grid does: the op's output bit for bit."""
    x, weights, ids, w1, w3, w2 = _case(test_seed, "fp4", n)
    run = lambda **o: np.asarray(moe_gemm(x, weights, ids, w1, w3, w2, swiglu_limit=LIMIT,  # noqa: E731
                                          act_quant_sim=act_quant_sim, act_quant_block=128, implementation="pallas",
                                          interpret=False, fp4_kernel="mosaic", mosaic_quad_waits=quads, **o))
    got = run(mosaic_consumers=consumers, mosaic_stages=stages)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got.view(np.uint32), run().view(np.uint32))
