"""The model with its Pallas kernels (kernels="pallas": the HLO interpreter on CPU) against its XLA path, on the
tiny V4 model in bf16 (reference-bf16 numerics, compact FP8 KV rows): each attention layer kind teacher-forced,
the MoE layer, and the choices reported in generation stats.

Layer by layer, not end to end: this random-weight model amplifies bf16 noise — flipping the last bit of half the
attention outputs alone moves its logits by ~0.1 of their scale (measured 1.0 of 10.6; the kernels: 1.2-1.9) —
so an end-to-end bound loose enough never to flake would say little."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsjax
from dsjax import kernel_choice
from dsjax.layers.attention import attention
from dsjax.layers.moe import moe
from dsjax.state import init_state


@pytest.fixture(scope="module")
def models():
    return {k: dsjax.load("tiny-v4", kernels=k, max_seq_len=128, max_batch=2) for k in ("xla", "pallas")}


@pytest.mark.parametrize("T", [48, 6], ids=["prefill-chunk-kernel", "verify-sparse-mqa-kernel"])
def test_attention_layers_match_xla(models, test_seed, T):
    """Each layer kind (window, CSA, HCA) over a chunk, same inputs and state: within the kernels' tolerance
    (2^-6 of the largest |output|: flash partials and the final bf16 rounding). 48 tokens take the chunk attention
    kernel, 6 (a verify block) the sparse MQA kernel."""
    cfg = models["xla"].cfg
    st = init_state(cfg, 2, 128)
    x = jax.random.normal(jax.random.key(test_seed), (2, T, cfg.dim), jnp.float32).astype(jnp.bfloat16)
    start, n = jnp.array([0, 0], jnp.int32), jnp.array([T, T - 2], jnp.int32)
    kinds = {}
    for i in range(cfg.n_layers):                       # the first layer of each kind
        kinds.setdefault(cfg.layer_ratio(i), i)
    for i in kinds.values():
        w = models["xla"].params.layers[i].attn
        want, got = (np.asarray(attention(x, w, cfg.replace(kernels=k), i, st.layers[i], start, n)[0], np.float32)
                     for k in ("xla", "pallas"))
        np.testing.assert_allclose(got, want, rtol=0, atol=2.0 ** -6 * np.abs(want).max(), err_msg=f"layer {i}")


def test_moe_layer_matches_xla(models, test_seed):
    """The MoE layer (route, routed experts through the kernel, shared expert): within one bf16 ulp of the
    output scale (the kernel's fp32 accumulation order may flip one rounding; observed: equal)."""
    cfg = models["xla"].cfg
    x = jax.random.normal(jax.random.key(test_seed), (2, 24, cfg.dim), jnp.float32).astype(jnp.bfloat16)
    tok = jax.random.randint(jax.random.key(test_seed + 1), (2, 24), 0, cfg.vocab_size)
    w = models["xla"].params.layers[cfg.n_hash_layers].ffn           # a top-k routed layer
    want, got = (np.asarray(moe(x, tok, w, cfg.replace(kernels=k)), np.float32) for k in ("xla", "pallas"))
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
    assert kernel_choice.choose(cfg.replace(kernels="auto"), "moe_gemm", rows=8, dtype=jnp.bfloat16, fmt="fp4") == "xla"
