"""Compact KV rows: byte sizes from the spec, lossless round trips, and a forward that cannot tell them apart."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsjax
from dsjax import kv_rows, quant
from dsjax.model import forward
from dsjax.params import init_params
from dsjax.state import init_state, state_bytes


def test_row_sizes_match_the_spec():
    cfg = dsjax.preset("v4-flash").with_numerics("reference-bf16")
    assert kv_rows.main_row_bytes(cfg) == 584      # 448 e4m3 + 7 ue8m0 + 64 bf16 rope (+1 pad)
    assert kv_rows.index_row_bytes(cfg) == 68      # 128 e2m1 nibbles + 4 ue8m0
    st = jax.eval_shape(lambda: init_state(cfg, 1, 1024))
    assert st.layers[2].compressor.entries.shape == (1, 256, 584) and st.layers[2].index.entries.shape == (1, 256, 68)
    assert st.layers[3].compressor.entries.shape == (1, 8, 584) and st.layers[0].window.shape == (1, 128, 584)
    # per token of context: 21 CSA x (584/4 + 68/4) + 20 HCA x 584/128 = 3514.25 B (spec §4.2), plus fixed windows
    fixed = state_bytes(cfg, 1, 0)
    per_token = (state_bytes(cfg, 1, 1 << 16) - fixed) / (1 << 16)
    assert per_token == pytest.approx(3514.25)


def test_round_trips_are_lossless(test_seed):
    cfg = dsjax.preset("v4-flash")
    rng = np.random.default_rng(test_seed)
    x = jnp.asarray(rng.normal(size=(4, 9, 512)) * np.exp(rng.normal(size=(4, 9, 1)) * 4), jnp.bfloat16)
    v = jnp.concatenate([quant.fp8_e4m3_sim(x[..., :448], 64), x[..., 448:]], axis=-1)
    back = kv_rows.unpack_main(kv_rows.pack_main(v, cfg), cfg)
    assert np.array_equal(np.asarray(back).view(np.uint16), np.asarray(v).view(np.uint16))
    k = quant.fp4_e2m1_sim(quant.hadamard(jnp.asarray(rng.normal(size=(4, 9, 128)) * 5, jnp.bfloat16)), 32)
    back = kv_rows.unpack_index(kv_rows.pack_index(k, cfg), cfg)
    assert np.array_equal(np.asarray(back).view(np.uint16), np.asarray(k).view(np.uint16))


@pytest.mark.parametrize("numerics", ["reference-bf16", "reference-fp8"])
def test_forward_with_compact_rows_equals_plain_caches(numerics, test_seed, monkeypatch):
    # one layer of each kind (window + hash routing, CSA with its index rows, HCA): every row kind, half the compile
    cfg = dsjax.preset("tiny-v4", vocab_size=1024, window_size=8, index_topk=4, n_layers=3,
                       compress_ratios=(0, 4, 16, 0), n_hash_layers=1).with_numerics(numerics)
    params = init_params(cfg, test_seed)
    ids = jnp.asarray(np.random.default_rng(test_seed).integers(0, 1024, (2, 40)), jnp.int32)
    compact = np.asarray(jax.jit(lambda p, i: forward(p, cfg, i))(params, ids))
    monkeypatch.setattr(kv_rows, "main_rows_compact", lambda cfg: False)
    monkeypatch.setattr(kv_rows, "index_rows_compact", lambda cfg: False)
    plain = np.asarray(jax.jit(lambda p, i: forward(p, cfg, i))(params, ids))
    assert np.array_equal(compact, plain)
