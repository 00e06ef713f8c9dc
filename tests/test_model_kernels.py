"""The model with its Pallas kernels (kernels="pallas": the HLO interpreter on CPU) against its XLA path, on the
tiny V4 model in bf16 (reference-bf16 numerics, compact FP8 KV rows): each attention layer kind teacher-forced,
the MoE layer, and the choices reported in generation stats.

Layer by layer, not end to end: this random-weight model amplifies bf16 noise — flipping the last bit of half the
attention outputs alone moves its logits by ~0.1 of their scale (measured 1.0 of 10.6; the kernels: 1.2-1.9) —
so an end-to-end bound loose enough never to flake would say little."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsjax
from dsjax import kernel_choice
from dsjax.layers.attention import attention
from dsjax.layers.moe import moe
from dsjax.params import init_params
from dsjax.state import init_state


# Jitted, both backends in one program: one compile per test instead of one per layer and backend (or hundreds
# of op-by-op dispatches, each its own compile).
@functools.partial(jax.jit, static_argnames=("cfg", "layers"))
def _attention_both(x, ws, sts, start, n, *, cfg, layers):
    """(xla, pallas) outputs of attention layer layers[j] with weights ws[j] and state sts[j]."""
    return [tuple(attention(x, w, cfg.replace(kernels=k), i, st, start, n)[0] for k in ("xla", "pallas"))
            for i, w, st in zip(layers, ws, sts)]


@functools.partial(jax.jit, static_argnames=("cfg",))
def _moe_both(x, tok, w, *, cfg):
    return tuple(moe(x, tok, w, cfg.replace(kernels=k)) for k in ("xla", "pallas"))


@pytest.fixture(scope="module")
def models():
    return {k: dsjax.load("tiny-v4", kernels=k, max_seq_len=128, max_batch=2) for k in ("xla", "pallas")}


@pytest.mark.parametrize("T", [24, 6], ids=["prefill-chunk-kernel", "verify-sparse-mqa-kernel"])
def test_attention_layers_match_xla(models, test_seed, T):
    """Each layer kind (window, CSA, HCA) over a chunk, same inputs and state: within the kernels' tolerance
    (2^-6 of the largest |output|: flash partials and the final bf16 rounding). 24 tokens take the chunk attention
    kernel, 6 (a verify block) the sparse MQA kernel."""
    cfg = models["xla"].cfg
    st = init_state(cfg, 2, 128)
    x = jax.random.normal(jax.random.key(test_seed), (2, T, cfg.dim), jnp.float32).astype(jnp.bfloat16)
    start, n = jnp.array([0, 0], jnp.int32), jnp.array([T, T - 2], jnp.int32)
    kinds = {}
    for i in range(cfg.n_layers):                       # the first layer of each kind
        kinds.setdefault(cfg.layer_ratio(i), i)
    layers = tuple(kinds.values())
    pairs = _attention_both(x, [models["xla"].params.layers[i].attn for i in layers], [st.layers[i] for i in layers],
                            start, n, cfg=cfg, layers=layers)
    for i, (want, got) in zip(layers, pairs):
        want, got = np.asarray(want, np.float32), np.asarray(got, np.float32)
        np.testing.assert_allclose(got, want, rtol=0, atol=2.0 ** -6 * np.abs(want).max(), err_msg=f"layer {i}")
    linears = kernel_choice.choices()["quant_linear"]    # the projections: the stored-format kernel at a verify block
    assert any(f"kernels=pallas rows={2 * T} chunk={T} " in c and c.endswith(f"-> {'xla' if 2 * T > 32 else 'pallas'}")
               for c in linears), linears


@pytest.mark.parametrize("width", [128, 256])
def test_moe_layer_matches_xla(models, test_seed, width):
    """The MoE layer (route, routed experts through the kernel, shared expert): within one bf16 ulp of the
    output scale (the kernel's fp32 accumulation order may flip one rounding; observed: equal). Width 256: experts
    the Mosaic FP4 kernel takes when compiled on a GPU (its steps are 256 columns; the tiny model's 128 keep the
    Triton kernels)."""
    cfg = models["xla"].cfg
    if width != cfg.dim:
        cfg = cfg.replace(dim=width, moe_inter_dim=width)
        w = init_params(cfg, test_seed).layers[cfg.n_hash_layers].ffn
    else:
        w = models["xla"].params.layers[cfg.n_hash_layers].ffn       # a top-k routed layer
    x = jax.random.normal(jax.random.key(test_seed), (2, 24, cfg.dim), jnp.float32).astype(jnp.bfloat16)
    tok = jax.random.randint(jax.random.key(test_seed + 1), (2, 24), 0, cfg.vocab_size)
    want, got = (np.asarray(y, np.float32) for y in _moe_both(x, tok, w, cfg=cfg))
    np.testing.assert_allclose(got, want, rtol=0, atol=2.0 ** -7 * np.abs(want).max())


def test_choices_are_reported(models, caplog):
    """Generation stats name each op's implementation (here: the XLA model on CPU); a choice is logged once."""
    gens = models["xla"].generate([[0, 5, 9, 11]], 1)  # the prefill's token: no decode loop to compile
    kernels = gens[0].stats["kernels"]
    assert kernels["sparse_mqa"] and all(c.endswith("-> xla") for c in kernels["sparse_mqa"]), kernels
    cfg = models["pallas"].cfg
    with caplog.at_level("INFO", logger="dsjax.kernels"):
        assert kernel_choice.choose(cfg, "sparse_mqa", rows=977, dtype=jnp.bfloat16) == "pallas"
        assert kernel_choice.choose(cfg, "sparse_mqa", rows=977, dtype=jnp.bfloat16) == "pallas"
        assert kernel_choice.choose(cfg, "moe_gemm", rows=977, dtype=jnp.float32, fmt="fp4") == "xla"  # fp32: none
    assert sum("sparse_mqa: kernels=pallas rows=977 chunk=1" in r.getMessage() for r in caplog.records) == 1
    assert "kernels=pallas rows=977 chunk=1 dtype=bfloat16 fmt=None -> pallas" in kernel_choice.choices()["sparse_mqa"]
    auto_moe = kernel_choice.choose(cfg.replace(kernels="auto"), "moe_gemm", rows=8, dtype=jnp.bfloat16, fmt="fp4")
    assert auto_moe == ("pallas" if jax.default_backend() == "gpu" else "xla")    # "auto": measured on the GPU
    # the stored-format linear is a decode / verify kernel: prefill chunks keep XLA's GEMM even under "pallas"
    assert kernel_choice.choose(cfg, "quant_linear", rows=12, chunk=6, dtype=jnp.bfloat16, fmt="fp8") == "pallas"
    assert kernel_choice.choose(cfg, "quant_linear", rows=2048, chunk=1024, dtype=jnp.bfloat16, fmt="fp8") == "xla"
    # the shared expert sees a prefill chunk's tokens flattened ([n, D]: chunk 1): its rows decide
    assert kernel_choice.choose(cfg, "quant_linear", rows=2048, chunk=1, dtype=jnp.bfloat16, fmt="fp8") == "xla"
    assert kernel_choice.choose(cfg, "quant_linear", rows=12, chunk=6, dtype=jnp.bfloat16, fmt="fp8",
                                sharded=True) == "xla"
    # a cache the Triton lowering cannot address (over 2^31 one-byte elements within 2^32 bytes): XLA, even when
    # the kernels are asked for — V4.1's 288-byte FP4 rows at 1M entries x 8 slots; 16 slots are past 2^32 bytes
    rows = lambda slots: jax.ShapeDtypeStruct((slots, 1 << 20, 288), jnp.uint8)  # noqa: E731
    assert kernel_choice.choose(cfg, "sparse_mqa", rows=8, dtype=jnp.bfloat16, operands=(rows(8),)) == "xla"
    assert kernel_choice.choose(cfg, "sparse_mqa", rows=8, dtype=jnp.bfloat16, operands=(rows(16),)) == "pallas"
    assert any(c.endswith("past the int32 offsets of the Triton lowering) -> xla")
               for c in kernel_choice.choices()["sparse_mqa"])


def test_v41_attention_layers_match_xla(test_seed):
    """V4.1 (tiny-v41, reference-bf16: compact 66-byte FP8 window rows and 36-byte FP4 compressed rows) through
    the sparse MQA kernel reading those rows in place, a 6-token verify block after a 40-token prefix, each CSA2
    role (window-only, ratio-2 source, Reuse, ratio-1 source + candidates, Reindex): within the kernel tolerance."""
    from dsjax.layers.csa2 import attention41
    from dsjax.v41_model import new_shared

    m = dsjax.load("tiny-v41", kernels="xla", max_seq_len=64, max_batch=2)
    cfg, params = m.cfg, m.params
    st = jax.jit(_random_v41_state, static_argnums=(0, 2))(cfg, jax.random.key(test_seed + 1), 40)  # one compile
    x = jax.random.normal(jax.random.key(test_seed), (2, 6, cfg.dim), jnp.float32).astype(jnp.bfloat16)
    start, n = st.lengths, jnp.array([6, 4], jnp.int32)
    roles = {0: "window", 2: "ratio-2 source", 3: "Reuse", 6: "ratio-1 source + candidates", 8: "Reindex"}

    @jax.jit
    def both(params, st, x):
        shared, pairs = new_shared(st), []
        for layer in range(max(roles) + 1):        # in order: later roles read what sources publish
            w, ls = params.layers[layer].attn, st.layers[layer]
            if layer in roles:                      # the kernel on a copy of what earlier layers published
                mine = dict(shared, sources=dict(shared["sources"]), pending=list(shared.get("pending", [])))
                got = attention41(x, w, cfg.replace(kernels="pallas"), layer, ls, mine, start, n)[0]
            want = attention41(x, w, cfg, layer, ls, shared, start, n)[0]
            if layer in roles:
                pairs.append((got, want))
        return pairs

    for role, (got, want) in zip(roles.values(), both(params, st, x)):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        np.testing.assert_allclose(got, want, rtol=0, atol=2.0 ** -6 * np.abs(want).max(), err_msg=role)


def _random_v41_state(cfg, key, length: int):
    """A V4.1 state at `length` tokens whose rings, compressed rows and index keys hold random values in their
    compact layouts (what a prefix would leave, without compiling the forward that makes it)."""
    import dataclasses

    from dsjax import kv_rows, quant, v41_rows
    from dsjax.v41_state import init_state41

    st = init_state41(cfg, 2, 64)
    keys = iter(jax.random.split(key, 3 * cfg.n_layers))
    d = cfg.head_dim

    def normal(shape):
        return jax.random.normal(next(keys), shape, jnp.float32) * 2.0

    layers = []
    for ls in st.layers:
        window = v41_rows.pack_window(quant.fp8_e4m3_sim(normal(ls.window.shape[:2] + (d,)), 32).astype(jnp.bfloat16), cfg)
        source = ls.source
        if source is not None:
            entries = v41_rows.quantize_main(normal(source.entries.shape[:2] + (d,)), cfg)
            ik = quant.fp4_e2m1_sim(normal(source.index_keys.shape[:2] + (cfg.index_head_dim,)), cfg.index_quant_block)
            source = dataclasses.replace(source, entries=entries, index_keys=kv_rows.pack_index(ik.astype(jnp.bfloat16), cfg))
        layers.append(dataclasses.replace(ls, window=window, source=source))
    return dataclasses.replace(st, lengths=jnp.full((2,), length, jnp.int32), layers=tuple(layers))


def test_per_op_overrides_take_precedence():
    """"MODE+OP=IMPL" sets one op for an ablation: where "auto" keeps XLA (HCA over 8,192 entries, on a GPU too;
    any shape on CPU) an override asks for the kernel; an override to XLA wins over "pallas"; a kernel still needs
    inputs it is built for (fp32 keeps XLA)."""
    cfg = dsjax.preset("tiny-v4").with_numerics("reference-bf16")
    bf16 = dict(rows=1024, chunk=1024, dtype=jnp.bfloat16, entries=8192)
    assert kernel_choice.choose(cfg.replace(kernels="auto"), "chunk_attention", **bf16) == "xla"
    assert kernel_choice.choose(cfg.replace(kernels="auto+chunk_attention=pallas"), "chunk_attention", **bf16) == "pallas"
    both = cfg.replace(kernels="pallas+moe_gemm=xla")
    assert kernel_choice.choose(both, "moe_gemm", rows=8, dtype=jnp.bfloat16, fmt="fp4") == "xla"
    assert kernel_choice.choose(both, "sparse_mqa", rows=8, dtype=jnp.bfloat16) == "pallas"
    assert kernel_choice.choose(cfg.replace(kernels="xla+moe_gemm=pallas"), "moe_gemm", rows=8,
                                dtype=jnp.float32, fmt="fp4") == "xla"
    assert both.kernel_mode == "pallas"


def test_auto_prefill_attention_rule():
    """On the H200 "auto" takes the chunk kernel for every layer kind at every context: measured faster than XLA
    (window, CSA, and HCA from 64 to 8,192 shared entries: 1.22x at a 1M cache since 2026-12-05), so the rule
    reads no context at all; off the GPU, "auto" keeps XLA."""
    assert kernel_choice._measured_faster("chunk_attention", 2048, None, 1024)
    cfg = dsjax.config.preset("tiny-v4").replace(kernels="auto")
    want = "pallas" if jax.default_backend() == "gpu" else "xla"
    for entries in (0, 1024, 8192):
        assert kernel_choice.choose(cfg, "chunk_attention", rows=2048, chunk=1024, dtype=jnp.bfloat16,
                                    entries=entries) == want


def test_auto_indexer_rule():
    """The indexer kernels where measured faster on the H200: decode-sized calls (≤ 8 rows: scoring + top-k)
    and prefill chunks of ≥ 64 tokens (`layers.chunk_indexer`: the scores); not verify-sized batches in between
    (32 slots x 6 queries: 0.94x). Off the GPU, "auto" keeps XLA."""
    faster = lambda rows, chunk: kernel_choice._measured_faster("indexer_topk", rows, None, chunk)  # noqa: E731
    assert faster(6, 6) and faster(1024, 1024) and faster(2048, 1024) and not faster(192, 6)
    cfg = dsjax.config.preset("tiny-v4").replace(kernels="auto")
    want = "pallas" if jax.default_backend() == "gpu" else "xla"
    assert kernel_choice.choose(cfg, "indexer_topk", rows=1024, chunk=1024, dtype=jnp.bfloat16) == want
