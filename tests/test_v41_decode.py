"""V4.1 decode: our chunked decode equals our full forward (fp32 `transformers` preset, bit for bit), and the
reference presets' decode follows the goldens — the corrected index-key path against the `_fixed` arrays, and
`reference_index_key_bug=True` against the official (buggy) ones, diverging from prefill where the reference does.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsjax import checkpoint
from dsjax.config import load_config
from dsjax.v41_model import forward_chunk41
from dsjax.v41_state import init_state41
from golden_cases import discover

CASES = discover("v4.1")
# One worker runs the module: the bug-switch test reads the fixed path's decode run (lru_cache) instead of redoing it.
pytestmark = [pytest.mark.skipif(not CASES, reason="no V4.1 golden case in tests/data/goldens"),
              pytest.mark.xdist_group("v41_decode")]
STEPS = 8


@functools.lru_cache(maxsize=None)
def load(numerics: str, bug: bool = False):
    case = CASES[0]
    cfg = load_config(case.path).with_numerics(numerics).replace(reference_index_key_bug=bug)
    return case, cfg, checkpoint.load_params(case.path, cfg)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _chunk(params, ids, state, n_valid, *, cfg):
    return forward_chunk41(params, cfg, ids, state, n_valid)


def test_v41_decode_equals_prefill_fp32(test_seed):
    """Prefill 29 tokens (a ratio-2 group left open), 8 single decode steps, then a 3-token verify block: every
    logit equals the one-chunk forward of the whole sequence. Two compiled shapes: a 40-token chunk (full forward,
    prefill and verify block through n_valid) and a 1-token step."""
    _, cfg, params = load("transformers")
    rng = np.random.default_rng(test_seed)
    ids = rng.integers(0, cfg.vocab_size, (2, 40)).astype(np.int32)
    T, max_seq = 40, 80

    def run(state, tokens, n):
        padded = np.zeros((2, tokens.shape[1] if tokens.shape[1] == 1 else T), np.int32)
        padded[:, : tokens.shape[1]] = tokens
        logits, state = _chunk(params, jnp.asarray(padded), state, jnp.full((2,), n, jnp.int32), cfg=cfg)
        return np.asarray(logits)[:, :n], state

    full, _ = run(init_state41(cfg, 2, max_seq), ids, T)
    got, state = run(init_state41(cfg, 2, max_seq), ids[:, :29], 29)
    pieces = [got]
    for p in range(29, 37):
        got, state = run(state, ids[:, p:p + 1], 1)
        pieces.append(got)
    got, state = run(state, ids[:, 37:40], 3)
    pieces.append(got)
    ours = np.concatenate(pieces, axis=1)
    print(f"decode vs full forward: max|Δ| {np.abs(ours - full).max():.3g} (logit std {full.std():.2f})")
    assert np.array_equal(ours, full)
    assert int(state.lengths[0]) == 40


@functools.lru_cache(maxsize=None)
def decode_run(bug: bool) -> dict:
    """Prompt prefilled as one 300-token chunk (n_valid = its length), then the golden's 8 decoded tokens fed one by
    one; also our full forward over the short prompt + its tokens (one chunk of the same 300-token shape)."""
    case, cfg, params = load("reference-bf16", bug)
    gold, inputs = case.golden("bf16"), case.inputs()
    suffix = "" if bug else "_fixed"
    out = {}
    for prompt in ("short", "long"):
        ids = inputs[f"{prompt}_tokens"].astype(np.int32)
        toks = gold[f"{prompt}/decode_tokens{suffix}"].astype(np.int32)
        n = ids.shape[1]
        chunk = np.zeros((2, 300), np.int32)
        chunk[:, :n] = ids
        _, state = _chunk(params, jnp.asarray(chunk), init_state41(cfg, 2, 320), jnp.full((2,), n, jnp.int32), cfg=cfg)
        steps = []
        for k in range(STEPS):
            logits, state = _chunk(params, jnp.asarray(toks[:, k:k + 1]), state, jnp.ones((2,), jnp.int32), cfg=cfg)
            steps.append(np.asarray(logits)[:, 0])
        out[prompt] = np.stack(steps)                                                   # [steps, b, V]
    ids = np.concatenate([inputs["short_tokens"], gold[f"short/decode_tokens{suffix}"][:, :STEPS]], 1).astype(np.int32)
    chunk = np.zeros((2, 300), np.int32)
    chunk[:, : ids.shape[1]] = ids
    full, _ = _chunk(params, jnp.asarray(chunk), init_state41(cfg, 2, 320), jnp.full((2,), ids.shape[1], jnp.int32), cfg=cfg)
    n = inputs["short_tokens"].shape[1]
    out["short_full"] = np.moveaxis(np.asarray(full)[:, n:n + STEPS], 1, 0)
    return out


@pytest.mark.parametrize("bug", [False, True], ids=["fixed", "reference_index_key_bug"])
def test_v41_decode_logits(bug):
    """Our decode steps against the reference's: the `_fixed` arrays for the corrected path, the official ones with
    the bug switch (tolerance: test_golden_v41's prefill tolerance, the 1-ulp chaos of this tiny model). Then our
    decode against our own full forward of the same tokens: equal on the fixed path; with the switch it departs at
    the first step whose ratio-2 group is still open (step 1 for the 37-token prompt, position 38), as the
    reference's own decode departs from its recompute (goldens README §6)."""
    case, _, _ = load("reference-bf16", bug)
    gold = case.golden("bf16")
    run = decode_run(bug)
    for prompt in ("short", "long"):
        ref = gold[f"{prompt}/decode_logits{'' if bug else '_fixed'}"]
        per_step = np.abs(run[prompt] - ref).max(axis=(1, 2))
        agree = float(np.mean(run[prompt].argmax(-1) == ref.argmax(-1)))
        print(f"{prompt} {'bug' if bug else 'fixed'}: decode max|Δ| per step {np.round(per_step, 3).tolist()}, "
              f"argmax agreement {agree:.0%}")
        # argmax over 16 positions: 69% (11) for the long prompt with the bug switch under AVX codegen, 81-100%
        # under AVX2 / SSE4.2 (`--xla_cpu_max_isa`, 2026-12-06)
        assert np.median(per_step) <= 1.5 and per_step.max() <= 2.5 and agree >= 0.625
    gap = np.abs(run["short"] - run["short_full"]).max(axis=(1, 2))
    print(f"decode vs own full forward ({'bug' if bug else 'fixed'}): {np.round(gap, 3).tolist()}")
    # In bf16, decode (1 row) and the full forward (300 rows) round their GEMMs differently, and how much shows
    # depends on the CPU: 0-0.02 with XLA:CPU's AVX2 codegen, up to 0.52 with SSE4.2 (`--xla_cpu_max_isa`, one AMD
    # EPYC, 2026-12-06). The reference's own decode-vs-recompute gap is up to 1.31 here; decode == full forward bit
    # for bit is test_v41_decode_equals_prefill_fp32's (fp32). So: within the reference's gap, and where the bug
    # switch departs is read against the fixed path's decode of the same tokens, which rounds alike.
    if not bug:
        noise = case.noise("bf16")["fixed_decode_vs_full_recompute"]["short/decode_vs_prefill_maxabs"]
        assert gap.max() <= max(noise)
    else:
        split = np.abs(run["short"] - decode_run(False)["short"]).max(axis=(1, 2))
        print(f"decode with the bug switch vs without: {np.round(split, 3).tolist()}")
        assert split[0] == 0 and split[1] > 0.5


def test_v41_through_the_public_api():
    """dsjax.load on the official-layout directory gives a V4.1 Model whose logits (model.forward dispatches to
    v41_model) follow the golden prefill within test_golden_v41's tolerance. (Model.generate runs the same
    forward_chunk41 in the decode loop; measured by hand: its greedy tokens equal the argmax of Model.logits over
    the produced sequence — a test of it would add ~60 s of compiles.)"""
    import dsjax

    case = CASES[0]
    model = dsjax.load(case.path, numerics="reference-bf16", max_seq_len=64, max_batch=2)
    assert model.cfg.family == "v4.1" and model.params.layers[1].engram is not None
    ref = case.golden("bf16")["short/prefill_logits"]
    ours = np.asarray(model.logits(case.inputs()["short_tokens"]))
    per_position = np.abs(ours - ref).max(axis=-1)
    print(f"Model.logits vs golden: median per-position max|Δ| {np.median(per_position):.3f}, max {per_position.max():.3f}")
    assert np.median(per_position) <= 0.5 and per_position.max() <= 2.0
