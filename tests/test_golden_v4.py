"""V4 against DeepSeek's official reference code: teacher-forced blocks and full logits (tests/data/goldens).

Tolerances come from the reference's own noise, recorded in each case's manifest: running a prompt row alone
instead of batched moves its logits by up to `row_noise` (0.18-0.24 bf16, 0.71-1.31 fp8), because torch's CPU
GEMMs round differently with the row count. An independent implementation cannot be closer than that.

The prefill, decode and MTP checks of a variant read one compiled forward (`full_run`); the module runs on one
xdist worker, so it compiles once.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import dsjax
from dsjax.model import block_forward, embed
from dsjax.state import init_state
from golden_cases import bf16_ulps, discover

CASES = discover("v4")
pytestmark = pytest.mark.xdist_group("golden_v4")
VARIANTS = {"bf16": "reference-bf16", "fp8": "reference-fp8"}


@functools.lru_cache(maxsize=None)
def load_case(case_name: str, variant: str):
    case = next(c for c in CASES if c.name == case_name)
    return case, dsjax.load(case.path, numerics=VARIANTS[variant])


@functools.partial(jax.jit, static_argnames=("cfg",))
def _blocks(hs, ids, layers, *, cfg):
    """Every block on its own input hs[layer], in one program (one compile instead of one per block)."""
    b, s = ids.shape
    st = init_state(cfg, b, s).layers
    start, n = jnp.zeros((b,), jnp.int32), jnp.full((b,), s, jnp.int32)
    return [block_forward(h, ids, w, cfg, layer, st[layer], start, n)[0] for layer, (h, w) in enumerate(zip(hs, layers))]


@pytest.mark.parametrize("variant", ["bf16", "fp8"])
@pytest.mark.parametrize("case_name", [c.name for c in CASES])
def test_blocks_teacher_forced(case_name, variant):
    """Each block fed the reference's own input reproduces the reference's output to a few bf16 ulps."""
    case, model = load_case(case_name, variant)
    cfg = model.cfg
    ids = jnp.asarray(case.inputs()["short_tokens"][:1].astype(np.int32))
    outs = case.golden(variant)["short/block_out_bf16bits"].view(ml_dtypes.bfloat16)  # [L, s, n, D]
    hs = [embed(model.params, cfg, ids)] + [jnp.asarray(outs[layer - 1][None]) for layer in range(1, cfg.n_layers)]
    report = []
    for layer, got in enumerate(_blocks(hs, ids, model.params.layers, cfg=cfg)):
        ulps = bf16_ulps(np.asarray(got[0], np.float32), outs[layer].astype(np.float32))   # [s, n, D]
        off = ulps > 4
        moved = (off.mean(axis=(1, 2)) > 0.05)                     # a token with > 5% of its elements off
        report.append((layer, float(np.mean(~off)), float(np.mean(~off[~moved])), np.nonzero(moved)[0].tolist()))
    for layer, within4, kept, moved in report:
        print(f"{case_name}/{variant} block {layer}: {within4:.5%} within 4 ulps; tokens with > 5% off: {moved}; "
              f"the other tokens {kept:.5%}")
    # The reference's own bits move with the CPU: the official code run on another x86 CPU (our torch harness, see
    # docs/numerics.md) puts block 0 at 99.80% within 4 ulps of these files, and so does ours with XLA:CPU's
    # codegen held to SSE4.2 or AVX. On one AMD EPYC, by the codegen ISA alone (`--xla_cpu_max_isa`: the vector
    # width sets fp32 reduction orders; 2026-12-06): tokens with > 5% of a block's elements off — elements near zero
    # after cancellation, many ulps off for any 1-ulp change upstream, cluster in a token, and a CSA block's top-k
    # can flip — 1 (SSE4.2), 2 (AVX2: block 0 at 99.54%), 4 (AVX: block 4 at 99.03%) of the 222 block-tokens; the
    # other tokens' elements 99.90-99.95% within 4 ulps over all blocks, 99.65% in the worst block. So: at most 3%
    # of the block-tokens moved (a real defect moves most), the rest 99.85% within 4 ulps over all blocks and no
    # block below 99.5% (bf16); fp8, which no ISA moved below 99.99%, 99.9% a block.
    moved_total = sum(len(r[3]) for r in report)
    assert moved_total <= 0.03 * len(report) * ids.shape[1], f"{moved_total} block-tokens with > 5% of elements off"
    total = float(np.mean([r[2] for r in report]))
    print(f"{case_name}/{variant}: {total:.4%} of the other tokens' block elements within 4 bf16 ulps")
    assert total >= 0.9985, f"only {total:.4%} of block elements within 4 bf16 ulps"
    per_block = 0.995 if variant == "bf16" else 0.999
    for layer, _, kept, _ in report:
        assert kept >= per_block, f"block {layer}: only {kept:.4%} of elements within 4 bf16 ulps"


@functools.partial(jax.jit, static_argnames=("cfg",))
def _logits_and_mtp(params, ids, nxt, *, cfg):
    """Main and MTP logits [b, s, V] of one forward (the MTP head sees h_i and token i+1, `nxt`)."""
    from dsjax.model import forward_hidden_chunk, head_logits
    from dsjax.mtp import mtp_hidden, mtp_logits

    b, s = ids.shape
    st = init_state(cfg, b, s, with_mtp=True)
    h, st = forward_hidden_chunk(params, cfg, ids, st)
    z, _ = mtp_hidden(params, cfg, h, nxt, st.mtp[0], jnp.zeros((b,), jnp.int32), jnp.full((b,), s, jnp.int32))
    return head_logits(h, params, cfg, params.hc_head, params.norm), mtp_logits(params, cfg, z)


@functools.lru_cache(maxsize=None)
def full_run(case_name: str, variant: str, prompt: str):
    """One compiled forward per variant serves the prefill, decode and MTP checks: the prompt followed by the
    reference's decoded tokens, padded to the longest prompt's width (the model is causal: neither the tokens
    after the prompt nor the padding move an earlier position's logits). -> (prompt length, decode steps, main
    logits, MTP logits) over the unpadded positions."""
    case, model = load_case(case_name, variant)
    gold, inputs = case.golden(variant), case.inputs()
    steps = gold[f"{prompt}/decode_logits"].shape[0]
    width = max(inputs[f"{p}_tokens"].shape[1] for p in ("short", "long")) + steps
    prompt_ids = inputs[f"{prompt}_tokens"].astype(np.int32)
    toks = gold[f"{prompt}/decode_tokens"].astype(np.int32)
    n = prompt_ids.shape[1]
    ids = np.concatenate([prompt_ids, toks[:, :steps]], axis=1)
    nxt = np.concatenate([ids[:, 1:], toks[:, steps:steps + 1]], axis=1)
    pad = lambda a: jnp.asarray(np.pad(a, ((0, 0), (0, width - a.shape[1]))))  # noqa: E731
    logits, mtp = _logits_and_mtp(model.params, pad(ids), pad(nxt), cfg=model.cfg)
    return n, steps, np.asarray(logits[:, :n + steps]), np.asarray(mtp[:, :n + steps])


@pytest.mark.parametrize("variant", ["bf16", "fp8"])
@pytest.mark.parametrize("prompt", ["short", "long"])
@pytest.mark.parametrize("case_name", [c.name for c in CASES])
def test_prefill_logits(case_name, variant, prompt):
    case, _ = load_case(case_name, variant)
    gold = case.golden(variant)
    pos = gold[f"{prompt}/prefill_positions"]
    ref = gold[f"{prompt}/prefill_logits"]
    ours = full_run(case_name, variant, prompt)[2][:, [int(p) for p in pos]]
    row_noise = case.noise(variant)["prefill_rows_run_one_at_a_time_vs_batched"][prompt]["max_abs"]
    diff = np.abs(ours - ref)
    per_position = diff.max(axis=-1).ravel()
    agree = float(np.mean(ours.argmax(-1) == ref.argmax(-1)))
    print(f"{case_name}/{variant}/{prompt}: max|Δ| {diff.max():.4f}, median per-position max|Δ| "
          f"{np.median(per_position):.4f}, mean|Δ| {diff.mean():.4f} (reference row noise {row_noise:.4f}), "
          f"argmax agreement {agree:.1%}")
    # Typical positions sit inside the reference's own batched-vs-single-row noise; a few positions behind a
    # flipped top-k/routing choice may reach a few times that (FP8/FP4 rounding amplifies a flip).
    assert np.median(per_position) <= row_noise
    assert diff.max() <= 4 * row_noise
    assert agree >= 0.9


@pytest.mark.parametrize("variant", ["bf16", "fp8"])
@pytest.mark.parametrize("prompt", ["short", "long"])
@pytest.mark.parametrize("case_name", [c.name for c in CASES])
def test_decode_logits_by_full_forward(case_name, variant, prompt):
    """The reference's 8 decode steps, recomputed by our full-sequence forward over prompt + decoded tokens."""
    case, _ = load_case(case_name, variant)
    gold = case.golden(variant)
    n, steps, logits, _ = full_run(case_name, variant, prompt)
    ours = logits[:, n:n + steps]  # [b, steps, V]
    ref = np.moveaxis(gold[f"{prompt}/decode_logits"], 0, 1)
    noise = case.noise(variant)["decode_vs_full_recompute"][f"{prompt}/decode_vs_prefill_maxabs"]
    diff = np.abs(ours - ref).max(axis=(0, 2))
    print(f"{case_name}/{variant}/{prompt} decode steps max|Δ|: {np.round(diff, 3).tolist()}; "
          f"reference decode-vs-recompute: {np.round(noise, 3).tolist()}")
    # The reference's own decode-vs-recompute gap (`noise`) plus our cross-implementation noise (which on
    # prefill positions of the same prompt already reaches the row noise): median within 1.5x, worst within 4x.
    assert np.median(diff) <= 1.5 * max(noise)
    assert diff.max() <= 4 * max(noise)


@pytest.mark.parametrize("variant", ["bf16", "fp8"])
@pytest.mark.parametrize("prompt", ["short", "long"])
@pytest.mark.parametrize("case_name", [c.name for c in CASES])
def test_mtp_logits(case_name, variant, prompt):
    """The MTP head over the prompt (h_i + token i+1 -> token i+2) and at the 8 decode positions."""
    case, _ = load_case(case_name, variant)
    gold = case.golden(variant)
    n, steps, _, ours = full_run(case_name, variant, prompt)
    pos = gold[f"{prompt}/prefill_positions"]
    ref = np.concatenate([gold[f"{prompt}/mtp_prefill_logits"], np.moveaxis(gold[f"{prompt}/mtp_logits"][1:], 0, 1)], 1)
    got = np.concatenate([ours[:, pos], ours[:, n:n + steps]], axis=1)
    per_position = np.abs(got - ref).max(axis=-1).ravel()
    row_noise = case.noise(variant)["prefill_rows_run_one_at_a_time_vs_batched"][prompt]["max_abs"]
    agree = float(np.mean(got.argmax(-1) == ref.argmax(-1)))
    print(f"{case_name}/{variant}/{prompt} MTP: max|Δ| {per_position.max():.4f}, median per-position "
          f"{np.median(per_position):.4f} (row noise {row_noise:.4f}), argmax agreement {agree:.1%}")
    assert np.median(per_position) <= row_noise
    assert per_position.max() <= 4.5 * row_noise    # short bf16: 4.03x under AVX codegen (`--xla_cpu_max_isa`)
    assert agree >= 0.8
