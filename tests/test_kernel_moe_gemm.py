"""dsjax.kernels.moe_gemm: reference == the model's routed_experts_dense (bit-exact); the xla paths (gathered
active experts, ragged_dot) and the Triton-lowered Pallas kernels (the HLO interpreter on CPU: outputs start
as NaN, so anything unwritten shows) vs the reference for bf16 / FP8-block / packed-FP4 expert weights, experts shared across tokens,
expert-parallel style picks (weight 0, repeated clipped ids), tokens with no local expert, n = 1 and n = 8."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lower_h200 import lower_for_h200
from weight_formats import BLOCKS

from dsjax.kernels.moe_gemm import moe_gemm
from dsjax.layers.moe import routed_experts_dense
from dsjax.weights import Linear, stored_linear

E, D, I, K = 8, 256, 256, 3          # scaled down from 256 experts x (7168 -> 2048), top-6
LIMIT = 1.0                          # the clamp bites: gate/up values are ~N(0, 0.8)


def _stack(key, out, inn, fmt):
    return stored_linear(jax.random.normal(key, (E, out, inn), jnp.float32) * 0.05, *BLOCKS[fmt])


def _case(seed, fmt, n):
    ks = jax.random.split(jax.random.key(seed), 6)
    w1, w3, w2 = _stack(ks[0], I, D, fmt), _stack(ks[1], I, D, fmt), _stack(ks[2], D, I, fmt)
    x = jax.random.normal(ks[3], (n, D), jnp.float32).astype(jnp.bfloat16)
    ids = jax.random.randint(ks[4], (n, K), 0, E // 2 if n > 1 else E).astype(jnp.int32)  # E/2: shared experts
    weights = jax.random.uniform(ks[5], (n, K), jnp.float32, 0.1, 1.0)
    if n > 1:
        ids = ids.at[1].set(ids[0])                          # two tokens with the same experts
        ids = ids.at[2].set(jnp.array([E - 1, E - 1, 1]))    # EP: non-local picks clipped to E-1, weight 0
        weights = weights.at[2, :2].set(0.0)
        weights = weights.at[3].set(0.0)                     # a token routed to no local expert
    return x, weights, ids, w1, w3, w2


def _run(case, impl, act_quant_sim):
    x, weights, ids, w1, w3, w2 = case
    opts = dict(interpret=True) if impl == "pallas" else {}
    return moe_gemm(x, weights, ids, w1, w3, w2, swiglu_limit=LIMIT, act_quant_sim=act_quant_sim,
                    act_quant_block=128, implementation=impl, **opts)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp4"])
def test_reference_is_routed_experts_dense(test_seed, fmt):
    for n in (1, 8):
        case = _case(test_seed, fmt, n)
        x, weights, ids, w1, w3, w2 = case
        for aq in (False, True):
            cfg = types.SimpleNamespace(act_quant_sim=aq, act_quant_block=128, swiglu_limit=LIMIT)
            want = routed_experts_dense(x, weights, ids, types.SimpleNamespace(w1=w1, w3=w3, w2=w2), cfg)
            np.testing.assert_array_equal(np.asarray(_run(case, "reference", aq)), np.asarray(want))


def _check(got, want):
    # Tolerance: the paths compute the same roundings on the same values and differ only in the fp32
    # accumulation order of the matmuls (ragged_dot / gathered einsum / the kernel's 128-wide tiles of the
    # intermediate dim for the down projection). Such a difference can flip a bf16 rounding of g, u, h or y,
    # i.e. one bf16 ulp (2^-8 relative) of one term; through the down projection and the sum over k experts
    # that stays below 2^-7 of the largest |output|. Observed: exact, except the last fp32 bit of the sum for a
    # token that picks one expert twice with nonzero weights (route's top-k never does).
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=2.0 ** -7 * max(1.0, np.abs(want).max()))


@pytest.mark.parametrize("n", [1, 8])
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp4"])
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_vs_reference(test_seed, impl, fmt, n):
    case = _case(test_seed, fmt, n)
    aq = fmt != "bf16"
    want = _run(case, "reference", aq)
    got = _run(case, impl, aq)
    _check(got, want)
    if n > 1:
        np.testing.assert_array_equal(np.asarray(got)[3], 0.0)    # no local expert -> exactly 0
    assert np.abs(np.asarray(want)).max() > 0




@pytest.mark.parametrize("fmt", ["bf16", "fp4"])
def test_one_token_pairs_in_place(test_seed, fmt):
    """One token's pairs are tiles in place (`single_token_tiles`, no sort): a repeated expert (merged onto its
    first pick) and a pick held by another shard (weight 0, in the middle of the ascending list) still give the
    reference's output, and the same tiles (by expert) as the general tile map."""
    from dsjax.kernels.moe_gemm import pallas_triton
    x, weights, ids, w1, w3, w2 = _case(test_seed, fmt, 1)
    ids = jnp.array([[5, 2, 5]], jnp.int32)                # sorted within the token: 2, 5, 5 (the repeat merged)
    weights = weights.at[0, 1].set(0.0)                    # expert 2 is not local
    case = (x, weights, ids, w1, w3, w2)
    _check(_run(case, "pallas", fmt != "bf16"), _run(case, "reference", fmt != "bf16"))
    key = jnp.array([E, 5, E], jnp.int32)                  # 2 dropped, 5 kept, its repeat merged
    _, tiles = pallas_triton.single_token_tiles(key, E)
    _, general = pallas_triton.tile_map(key, E, 1)
    experts = lambda t: [int(e) for e in np.asarray(t)[:, 0] if e >= 0]  # noqa: E731
    assert experts(tiles) == experts(general) == [5]
    assert np.asarray(tiles).tolist() == [[-1, 0, 1], [5, 1, 2], [-1, 2, 3]]


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_counted_tile_map_is_the_sorted_one(test_seed, block_m):
    """Decode / verify batches count ([P, P] compares) instead of sorting: the same pair order (a stable sort by
    expert) and the same tiles (expert, first pair, end of the expert's pairs) as `tile_map`, dropped pairs in none."""
    from dsjax.kernels.moe_gemm import pallas_triton
    rng = np.random.default_rng(test_seed)
    for P in (2, 12, 48, 200):
        key = jnp.asarray(rng.integers(0, 10, P), jnp.int32)          # 9 experts, key 9 = dropped: many repeats
        # each map in one jit (as the op runs it): its eager form compiled ~50 small programs a size
        order, tiles = jax.jit(pallas_triton.counted_tile_map, static_argnums=(1, 2))(key, 9, block_m)
        want_order, want_tiles = jax.jit(pallas_triton.tile_map, static_argnums=(1, 2))(key, 9, block_m)
        np.testing.assert_array_equal(np.asarray(order), np.asarray(want_order))
        used = lambda t: sorted(map(tuple, np.asarray(t)[np.asarray(t)[:, 0] >= 0].tolist()))  # noqa: E731
        assert used(tiles) == used(want_tiles), P


def test_picks_in_expert_order_is_the_stable_sort(test_seed):
    """Each token's picks put in ascending expert order by counting: the stable argsort's permutation exactly,
    repeated experts within a token included (they keep their pick order)."""
    from dsjax.kernels.moe_gemm import pallas_triton
    rng = np.random.default_rng(test_seed)
    for n, k, E in ((1, 6, 256), (7, 6, 4), (33, 8, 3)):            # few experts: many repeats within a token
        ids = jnp.asarray(rng.integers(0, E, (n, k)), jnp.int32)
        got = np.asarray(pallas_triton.picks_in_expert_order(ids))
        np.testing.assert_array_equal(got, np.asarray(jnp.argsort(ids, axis=-1, stable=True)), err_msg=f"{n}x{k}")


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_fp8_32x32_blocks(test_seed, impl):
    case = _case(test_seed, "fp8b32", 8)
    _check(_run(case, impl, True), _run(case, "reference", True))


def test_xla_both_paths_agree(test_seed):
    """n·k >= E takes ragged_dot; the same tokens one at a time take the gathered path."""
    case = _case(test_seed, "fp8", 8)
    x, weights, ids, w1, w3, w2 = case
    full = _run(case, "xla", True)
    rows = [_run((x[i:i + 1], weights[i:i + 1], ids[i:i + 1], w1, w3, w2), "xla", True) for i in range(8)]
    _check(full, jnp.concatenate(rows))


def test_prefill_sized_batch(test_seed):
    """Many tokens (n·k >> E): the kernels run as a grouped GEMM over the sorted pairs, several tiles per expert
    (72 tokens: the prefill tiles of 32 pairs)."""
    case = _case(test_seed, "fp4", 72)
    _check(_run(case, "pallas", True), _run(case, "xla", True))


@pytest.mark.parametrize("fmt,opts,kernels", [
    ("fp8", {}, 4), ("fp8", dict(fused=False), 4), ("fp8", dict(in_kernel_quant=True), 2),
    ("fp8", dict(codes_kernel=False), 2), ("fp4", {}, 2), ("fp4", dict(fused=True), 2)])
def test_pallas_lowers_for_h200(fmt, opts, kernels):
    """V4-Flash expert shapes (4096 -> 2048, 256 experts, top-6, 8 tokens) lower to two Triton GEMM kernels — plus,
    in the FP8 form, the x and h codes kernels — with the fused epilogue and without (the interpreter runs ops
    Triton has no lowering for)."""
    from dsjax.kernels.moe_gemm import pallas_triton
    S = jax.ShapeDtypeStruct
    E_, D_, I_, n = 256, 4096, 2048, 8
    if fmt == "fp8":
        lin = lambda o, i: Linear(S((E_, o, i), jnp.float8_e4m3fn), S((E_, o // 128, i // 128), jnp.uint8), "fp8", 128)
    else:
        lin = lambda o, i: Linear(S((E_, o, i // 2), jnp.uint8), S((E_, o, i // 32), jnp.uint8), "fp4", 32)
    f = lambda x, w, ids, a, b, c: pallas_triton.moe_gemm(x, w, ids, a, b, c, swiglu_limit=10.0, act_quant_sim=True,
                                                          act_quant_block=128, interpret=False, **opts)
    text = lower_for_h200(f, S((n, D_), jnp.bfloat16), S((n, 6), jnp.float32), S((n, 6), jnp.int32),
                          lin(I_, D_), lin(I_, D_), lin(D_, I_))
    assert text.count("xla.gpu.triton") == kernels


def test_v41_expert_stacks_are_indexed_in_words():
    """V4.1-Flash's FP4 gate/up stacks (384 x 2304 x 5120 codes = 2.26e9 bytes) lie where Pallas' Triton lowering
    computes int32 element offsets that wrap (an illegal address on the H200): the kernels read them as 32-bit
    words (565M elements) and lower; the byte view is refused with a clear error instead of running."""
    from dsjax.kernels.common import check_offsets, offsets_fit
    from dsjax.kernels.moe_gemm import pallas_triton
    S = jax.ShapeDtypeStruct
    E_, D_, I_, n = 384, 5120, 2304, 8
    lin = lambda o, i: Linear(S((E_, o, i // 2), jnp.uint8), S((E_, o, i // 32), jnp.uint8), "fp4", 32)  # noqa: E731
    byte_view = S((E_, I_, D_ // 2), jnp.uint8)
    assert not offsets_fit(byte_view) and offsets_fit(S((E_, I_, D_ // 8), jnp.uint32))
    assert offsets_fit(S((256, 2048, 2048), jnp.uint8))           # V4-Flash's stacks: 1.07e9 bytes
    with pytest.raises(ValueError, match="wrapping int32 offsets"):
        check_offsets("moe_gemm_up", byte_view)
    f = lambda x, w, ids, a, b, c: pallas_triton.moe_gemm(x, w, ids, a, b, c, swiglu_limit=10.0, act_quant_sim=True,  # noqa: E731
                                                          act_quant_block=128, interpret=False)
    text = lower_for_h200(f, S((n, D_), jnp.bfloat16), S((n, 6), jnp.float32), S((n, 6), jnp.int32),
                          lin(I_, D_), lin(I_, D_), lin(D_, I_))
    assert text.count("xla.gpu.triton") == 2


def test_fp4_bf16_pair_recipe_decodes_every_code(test_seed):
    """The compiled kernels' FP4 decode (`common.fp4_bf16_asm`, PTX) runs `fp4_pair_bits` then x 2^126: checked in
    numpy (IEEE subnormals, as the GPU's bf16 fma keeps them) against the integer e2m1 decode for every 16-bit
    low half (all codes of nibbles 0-3, signs and zeros included) under random high halves (nibbles 4-7)."""
    from dsjax.kernels.common import fp4_code_to_f32, fp4_pair_bits

    rng = np.random.default_rng(test_seed)
    low = np.arange(1 << 16, dtype=np.uint32)
    words = low | (rng.integers(0, 1 << 16, low.shape, dtype=np.uint32) << 16)
    as_f32 = lambda half: (half.astype(np.uint32) << 16).view(np.float32) * np.float32(2.0 ** 126)  # noqa: E731
    for p in range(4):
        bits = np.asarray(fp4_pair_bits(jnp.asarray(words), p), np.uint32)
        for nib, half in ((p, bits & 0xFFFF), (p + 4, bits >> 16)):
            want = np.asarray(fp4_code_to_f32(jnp.asarray((words >> (4 * nib)) & 0xF)), np.float32)
            got = as_f32(half)
            np.testing.assert_array_equal(got, want, err_msg=f"nibble {nib}")
            assert np.array_equal(np.signbit(got), np.signbit(want)), f"nibble {nib}: signed zeros"


def test_fp4_e4m3_bytes_are_the_codes_times_2_pow_minus_6(test_seed):
    """The FP8 tensor-core form's FP4 decode (`common.fp4_e4m3_values`: bits moved, no arithmetic) gives every
    e2m1 code at every nibble position as an e4m3 value equal to the code's value times 2^-6, signed zeros kept,
    in column order (code 8j + p at column 8j + p)."""
    from dsjax.kernels.common import fp4_code_to_f32, fp4_e4m3_values

    rng = np.random.default_rng(test_seed)
    words = rng.integers(0, 1 << 32, (64, 16), dtype=np.uint64).astype(np.uint32)
    words[0, :2] = np.array([0x76543210, 0xFEDCBA98], np.uint32)          # every code, in order
    got = np.asarray(fp4_e4m3_values(jnp.asarray(words)).astype(jnp.float32))
    codes = (words[:, :, None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF
    want = np.asarray(fp4_code_to_f32(jnp.asarray(codes.reshape(64, 128)))) * np.float32(2.0 ** -6)
    np.testing.assert_array_equal(got, want)
    assert np.array_equal(np.signbit(got), np.signbit(want))


@pytest.mark.parametrize("fmt,form", [("fp8", "pieces"), ("fp4", "pieces"), ("fp4", "groups")])
def test_fp8_operands_with_fp8_activations(test_seed, fmt, form):
    """FP8 activations and FP8 / FP4 experts with `fp8_mma`: the kernels take e4m3 codes (the FP8 tensor-core form:
    a dot per weight piece, or for FP4 a chunk's scale blocks side by side on N, `fp8_dot="groups"`) and match the
    reference at 1 and 8 tokens, and the bf16-operand form (`fp8_mma=False`) on the same inputs."""
    from dsjax.kernels.moe_gemm import pallas_triton

    for n in (1, 8):
        x, weights, ids, w1, w3, w2 = case = _case(test_seed, fmt, n)
        run = lambda **o: pallas_triton.moe_gemm(x, weights, ids, w1, w3, w2, swiglu_limit=LIMIT,  # noqa: E731
                                                 act_quant_sim=True, act_quant_block=128, interpret=True, **o)
        text = str(jax.make_jaxpr(lambda: run(fp8_mma=True, fp8_dot=form))())
        assert "f8_e4m3fn" in text.split("pallas_call")[1], "the kernel does not take e4m3 operands"
        got = run(fp8_mma=True, fp8_dot=form)
        _check(got, _run(case, "reference", True))
        _check(got, run(fp8_mma=False))


def test_fp4_asm_decode_lowers_for_h200():
    """With the PTX decode the FP4 expert kernels (bf16 operands) still lower to two Triton kernels (the interpreter,
    which cannot run PTX, keeps the jnp decode: every other test here)."""
    from dsjax.kernels.moe_gemm import pallas_triton
    S = jax.ShapeDtypeStruct
    E_, D_, I_, n = 16, 512, 256, 4
    lin = lambda o, i: Linear(S((E_, o, i // 2), jnp.uint8), S((E_, o, i // 32), jnp.uint8), "fp4", 32)  # noqa: E731
    for asm in (True, False):
        f = lambda x, w, ids, a, b, c: pallas_triton.moe_gemm(x, w, ids, a, b, c, swiglu_limit=10.0,  # noqa: E731
                                                              act_quant_sim=True, act_quant_block=128,
                                                              interpret=False, fp4_asm=asm, fp8_mma=False)
        text = lower_for_h200(f, S((n, D_), jnp.bfloat16), S((n, 6), jnp.float32), S((n, 6), jnp.int32),
                              lin(I_, D_), lin(I_, D_), lin(D_, I_))
        assert text.count("xla.gpu.triton") == 2
        assert ("fma.rn.bf16x2" in text) == asm
        # the glue around the kernels has no loop: searchsorted's default scan was ~30 µs of tiny launches a call
        assert "stablehlo.while" not in text


def test_bf16x2_scale_holds_every_block_scale_twice():
    """The PTX decode's scale operand: for each of the 256 ue8m0 bytes, both bf16 halves equal the fp32 scale."""
    from dsjax.kernels.common import bf16x2_scale, e8m0_to_f32
    scale = e8m0_to_f32(jnp.arange(256, dtype=jnp.uint8))
    pair = np.asarray(bf16x2_scale(scale)).astype(np.uint32)
    for half in (pair & 0xFFFF, pair >> 16):
        got = np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(half, jnp.uint16), jnp.bfloat16), np.float32)
        np.testing.assert_array_equal(got, np.asarray(scale))


def test_fp4_asm_results_are_signless_for_triton(capsys):
    """Triton's verifier refuses an unsigned result type on `tt.elementwise_inline_asm` (the H200's first run of
    the PTX decode failed so): the Triton module the lowering builds carries signless i32 results."""
    from jax.experimental import pallas as pl
    from dsjax.kernels.common import fp4_bf16_asm

    def kernel(w_ref, s_ref, o_ref):
        o_ref[...] = sum(v.astype(jnp.float32) for v in fp4_bf16_asm(w_ref[...], s_ref[...]))

    f = lambda w, s: pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 16), jnp.float32),  # noqa: E731
                                    debug=True, interpret=False)(w, s)
    capsys.readouterr()
    lower_for_h200(f, jax.ShapeDtypeStruct((16, 16), jnp.uint32), jax.ShapeDtypeStruct((16, 16), jnp.float32))
    asm = [line for line in capsys.readouterr().out.splitlines() if "tt.elementwise_inline_asm" in line]
    assert len(asm) == 4, asm
    assert all(line.rstrip().split(" -> ")[1].startswith("tensor<16x16xi32>") for line in asm), asm


def test_fp4_ptx_assembles_for_sm90(tmp_path):
    """The PTX FP4 decode's four statements, with their operands bound to registers in a small kernel, pass
    NVIDIA's assembler for the H200 (sm_90): mnemonics, types and operand forms are real (no GPU needed)."""
    import os
    import subprocess

    import nvidia.cuda_nvcc
    from dsjax.kernels.common import _fp4_bf16_pair_ptx

    ptxas = os.path.join(list(nvidia.cuda_nvcc.__path__)[0], "bin", "ptxas")
    body = "".join(_fp4_bf16_pair_ptx(p).replace("$0", "%r_o").replace("$1", "%r_w").replace("$2", "%r_s")
                   + f"\nst.global.b32 [%rd_o+{4 * p}], %r_o;\n" for p in range(4))
    kernel = (".version 8.0\n.target sm_90\n.address_size 64\n"
              ".visible .entry k(.param .u64 pw, .param .u64 ps, .param .u64 po)\n{\n"
              ".reg .b32 %r_w, %r_o, %r_s;\n.reg .b64 %rd_w, %rd_s, %rd_o;\n"
              "ld.param.u64 %rd_w, [pw];\nld.param.u64 %rd_s, [ps];\nld.param.u64 %rd_o, [po];\n"
              "ld.global.b32 %r_w, [%rd_w];\nld.global.b32 %r_s, [%rd_s];\n" + body + "ret;\n}\n")
    src = tmp_path / "fp4.ptx"
    src.write_text(kernel)
    proc = subprocess.run([ptxas, "--gpu-name", "sm_90", str(src), "-o", str(tmp_path / "fp4.cubin")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    src.write_text(kernel.replace("or.b32 fq_p, fq_m, fq_s;", "or.b32 fq_p, fq_m, fq_q;"))  # the check can fail
    assert subprocess.run([ptxas, "--gpu-name", "sm_90", str(src), "-o", str(tmp_path / "bad.cubin")],
                          capture_output=True, timeout=60).returncode != 0


@pytest.mark.parametrize("fmt,block_m,block_k", [("fp4", 4, 128), ("fp4", 2, 256), ("fp8", 2, 128), ("bf16", 4, 128)])
def test_gemv_tiles(test_seed, fmt, block_m, block_k):
    """Tiles under 16 pairs take the GEMV form (FP4's default at ≤ 8 tokens): tiles with one live pair run as one
    row, fuller ones as block_m rows, and experts with more pairs than a tile holds span two (checked below)."""
    x, weights, ids, w1, w3, w2 = _case(test_seed, fmt, 8)
    ids = ids.at[:2].set(jnp.array([0, 1, 2]))                             # experts 0 and 1: 5 pairs each, 2: four
    ids = ids.at[4:8].set(jnp.array([[4, 0, 1], [5, 0, 2], [6, 1, 2], [7, 3, 0]]))  # experts 4-7: one pair each
    weights = weights.at[4:8].set(0.5)
    counts = np.bincount(np.asarray(ids)[np.asarray(weights) > 0], minlength=E)
    assert (counts[4:] == 1).all() and (counts[:2] > block_m).all(), counts
    got = moe_gemm(x, weights, ids, w1, w3, w2, swiglu_limit=LIMIT, act_quant_sim=True, act_quant_block=128,
                   implementation="pallas", interpret=True, block_m=block_m, block_k=block_k, fp8_mma=False)
    _check(got, _run((x, weights, ids, w1, w3, w2), "reference", True))


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the PTX decode runs only on an NVIDIA GPU")
@pytest.mark.parametrize("n", [1, 8, 40])
def test_fp4_asm_equals_jnp_decode_on_gpu(test_seed, n):
    """On the GPU the PTX FP4 decode gives the same kernel output, bit for bit, as the jnp decode (both produce the
    same bf16 weights; the sums are then the same program) — the check the CPU interpreter cannot make."""
    x, weights, ids, w1, w3, w2 = _case(test_seed, "fp4", n)
    out = {asm: np.asarray(moe_gemm(x, weights, ids, w1, w3, w2, swiglu_limit=LIMIT, act_quant_sim=True,
                                    act_quant_block=128, implementation="pallas", interpret=False, fp4_asm=asm,
                                    fp8_mma=False).astype(jnp.float32)) for asm in (False, True)}
    assert np.isfinite(out[False]).all()
    np.testing.assert_array_equal(out[True], out[False])
    _check(out[False], np.asarray(_run((x, weights, ids, w1, w3, w2), "reference", True)))


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="FP8 tensor cores run only on an NVIDIA GPU")
@pytest.mark.parametrize("fmt,form", [("fp8", "pieces"), ("fp4", "pieces"), ("fp4", "groups")])
@pytest.mark.parametrize("n", [1, 8, 40])
def test_fp8_mma_matches_bf16_operands_on_gpu(test_seed, fmt, form, n):
    """Compiled, the FP8 tensor-core form equals the bf16-operand form and the reference within `_check`'s bound
    (the same exact products; only the accumulation order differs)."""
    x, weights, ids, w1, w3, w2 = case = _case(test_seed, fmt, n)
    out = {mma: np.asarray(moe_gemm(x, weights, ids, w1, w3, w2, swiglu_limit=LIMIT, act_quant_sim=True,
                                    act_quant_block=128, implementation="pallas", interpret=False, fp8_mma=mma,
                                    fp8_dot=form))
           for mma in (False, True)}
    assert np.isfinite(out[True]).all()
    _check(out[True], out[False])
    _check(out[True], np.asarray(_run(case, "reference", True)))


@pytest.mark.parametrize("fmt,opts", [("bf16", dict(fused=True)), ("fp4", dict(fused=True)),
                                      ("fp8", dict(fused=False)), ("fp8", dict(in_kernel_quant=True))])
def test_fused_epilogue_setting_that_is_not_the_default(test_seed, fmt, opts):
    """`fused` (one split; the up kernel writes h with SwiGLU, routing weight and roundings, the down kernel y) is
    the FP8 form's default: the other settings — fused bf16 / FP4 experts, unfused FP8, FP8 activations quantized
    in the kernels (`in_kernel_quant`) — still match the reference at 1 and 8 tokens (duplicate experts, a pick
    held by another shard, a token with no local expert)."""
    for n in (1, 8):
        x, weights, ids, w1, w3, w2 = case = _case(test_seed, fmt, n)
        got = moe_gemm(x, weights, ids, w1, w3, w2, swiglu_limit=LIMIT, act_quant_sim=fmt != "bf16",
                       act_quant_block=128, implementation="pallas", interpret=True, **opts)
        _check(got, _run(case, "reference", fmt != "bf16"))
        if n > 1:
            np.testing.assert_array_equal(np.asarray(got)[3], 0.0)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiled kernels run only on an NVIDIA GPU")
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp4"])
@pytest.mark.parametrize("n", [1, 8, 40])
def test_fused_matches_split_on_gpu(test_seed, fmt, n):
    """Compiled, the fused kernels (in-kernel SwiGLU, exp and division in Triton; for FP8 also with in-register
    activation quantization) equal the split ones with XLA's glue within `_check`'s bound, and the reference."""
    x, weights, ids, w1, w3, w2 = case = _case(test_seed, fmt, n)
    variants = dict(split=dict(fused=False), fused=dict(fused=True))
    if fmt == "fp8":
        variants["in_kernel_quant"] = dict(fused=True, in_kernel_quant=True)
    out = {v: np.asarray(moe_gemm(x, weights, ids, w1, w3, w2, swiglu_limit=LIMIT, act_quant_sim=fmt != "bf16",
                                  act_quant_block=128, implementation="pallas", interpret=False, **o))
           for v, o in variants.items()}
    for v in variants:
        assert np.isfinite(out[v]).all(), v
        _check(out[v], out["split"])
        _check(out[v], np.asarray(_run(case, "reference", fmt != "bf16")))


@pytest.mark.parametrize("rows,cols", [(1, 256), (22, 384)])
def test_act_codes_kernel_is_fp8_e4m3_codes(test_seed, rows, cols):
    """`act_codes.fp8_codes` (the FP8 form's x and h codes in one kernel) equals `quant.fp8_e4m3_codes` bit for bit:
    a partial last program, a zero block (the amax floor), magnitudes over 2^±30, bf16 input; on a GPU compiled
    as well as interpreted."""
    from dsjax.kernels.moe_gemm.act_codes import fp8_codes
    from dsjax import quant
    rng = np.random.default_rng(test_seed)
    x = rng.standard_normal((rows, cols)) * np.exp2(rng.uniform(-30, 30, (rows, cols // 128))).repeat(128, -1)
    x[0, :128] = 0.0
    x = jnp.asarray(x, jnp.float32).astype(jnp.bfloat16)
    want_codes, want_scales = quant.fp8_e4m3_codes(x, 128)
    for interpret in (True, False) if jax.default_backend() == "gpu" else (True,):      # compiled too on a GPU
        codes, scales = fp8_codes(x, 128, interpret=interpret)
        assert codes.dtype == jnp.float8_e4m3fn and scales.shape == (rows, cols // 128)
        np.testing.assert_array_equal(np.asarray(codes).view(np.uint8), np.asarray(want_codes).view(np.uint8))
        np.testing.assert_array_equal(np.asarray(scales), np.asarray(want_scales))


def test_in_kernel_quantization_needs_fp8_chunks_of_one_scale_block():
    from dsjax.kernels.moe_gemm import pallas_triton
    x, weights, ids, w1, w3, w2 = _case(0, "fp4", 1)
    tiles = jnp.zeros((1, 3), jnp.int32)
    with pytest.raises(ValueError, match="in-kernel activation quantization"):
        pallas_triton.grouped_matmul("t", x, [w2], tiles, None, D, 64, 128, 16, jnp.bfloat16, None, True, 1,
                                     act_block=128, quantize=True, fused=True)


def test_unknown_fp8_dot_is_refused():
    from dsjax.kernels.moe_gemm import pallas_triton
    x, weights, ids, w1, w3, w2 = _case(0, "fp4", 1)
    with pytest.raises(ValueError, match="fp8_dot must be"):
        pallas_triton.moe_gemm(x, weights, ids, w1, w3, w2, swiglu_limit=LIMIT, act_quant_sim=True,
                               act_quant_block=128, interpret=True, fp8_dot="wx")
