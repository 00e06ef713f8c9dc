"""Layer slices of V4-Flash and V4.1-Flash: the real layer shapes and formats with fewer layers (and, optionally,
experts), so one GPU can time what the full model does per layer.

`--model slice:v4-flash[:LAYERS[:EXPERTS]]` names one. `pattern="model"` takes the model's own first LAYERS
layers (two window layers, then CSA/HCA alternating; hash-routed first three), so the layers a longer slice adds
are the ones the full model repeats and a linear fit over two depths extrapolates to the full depth;
`pattern="cycle"` cycles window / CSA / HCA (every kind in three layers, for kernel comparisons).

V4.1 (`slice:v4.1-flash[:LAYERS[:EXPERTS]]`, 3 ≤ LAYERS ≤ 8): the first LAYERS of eight representative layers of
the full model — window, window + Engram, the ratio-2 KV source, a ratio-2 Reuse layer, the next ratio-2 source,
the ratio-1 KV source (also the candidate-block source), a ratio-1 Reuse layer and a ratio-1 Reindex layer — with
the CSA2 roles remapped to the slice, DSpark reading the slice's last three layers, no vision tower, and the
Engram tables cut to 2^24 rows (4.3 GB instead of 98 GB each: a lookup gathers the same rows per token whatever
the table's length, so only capacity differs).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dsjax.config import ModelConfig, preset
from dsjax.errors import ConfigError
from dsjax.state import init_state

# family -> (preset, overrides). tiny-v4: CPU tests of the same path; tiny-v4-tp: its shapes widened so every
# tensor-parallel split of up to 8 devices divides (CPU tests of `dsjax bench tp`)
SLICE_FAMILIES = {"v4-flash": ("v4-flash", {}), "tiny-v4": ("tiny-v4", {}),
                  "tiny-v4-tp": ("tiny-v4", dict(n_heads=8, o_groups=8, o_lora_rank=128, moe_inter_dim=1024,
                                                 index_n_heads=16))}
DEFAULT_SLICE_LAYERS = 8
V41_FAMILIES = {"v4.1-flash": ("v4.1-flash", (0, 1, 2, 3, 8, 20, 21, 24)),   # family -> (preset, layers picked)
                "tiny-v41": ("tiny-v41", (0, 1, 2, 3, 6, 7, 8, 9))}
V41_SLICE_ENGRAM_ROWS = 1 << 24


def _cut_engram(full: ModelConfig, n_layers: int) -> dict:
    """Config fields of Engram tables cut to ~V41_SLICE_ENGRAM_ROWS rows: hash primes drawn from a smaller base
    (the rows a table has are its primes' sum), so lookups stay in range; per token the same hashes and rows."""
    from dsjax.layers.engram import engram_primes

    terms = (full.engram_max_ngram_size - 1) * full.engram_n_heads
    vocab = min(full.engram_vocab_size, V41_SLICE_ENGRAM_ROWS // terms)
    primes = engram_primes(n_layers, full.engram_max_ngram_size, full.engram_n_heads, vocab)
    return dict(engram_vocab_size=vocab, engram_num_embeddings=tuple(int(p.sum()) for p in primes))


def slice_config41(layers: int, experts: int, *, family: str = "v4.1-flash") -> ModelConfig:
    """V4.1 with the first `layers` of the family's representative layers (module docstring)."""
    base, picks = V41_FAMILIES[family]
    full = preset(base)
    if not 3 <= layers <= len(picks):
        raise ConfigError(f"a {family} slice has 3..{len(picks)} layers (DSpark reads three), got {layers}")
    if experts < full.n_activated_experts:
        raise ConfigError(f"a slice needs at least {full.n_activated_experts} experts (top-k), got {experts}")
    picks = picks[:layers]
    at = {full_id: i for i, full_id in enumerate(picks)}
    kept = lambda ids: tuple(at[i] for i in ids if i in at)
    engram = [at[i] for i in full.engram_layer_ids if i in at]
    cfg = preset(base, n_layers=layers, n_routed_experts=experts, vision_n_layers=0,
                 compress_ratios=tuple(full.compress_ratios[i] for i in picks) + full.compress_ratios[full.n_layers:],
                 kv_source_layers=kept(full.kv_source_layers), index_source_layers=kept(full.index_source_layers),
                 candidate_source_layer=at.get(full.candidate_source_layer, -1),
                 engram_layer_ids=tuple(engram), **_cut_engram(full, len(engram)),
                 dspark_target_layer_ids=tuple(range(layers - 3, layers)))
    return cfg.replace(name=f"{family}-slice{layers}x{experts}")


def slice_config(layers: int, experts: int = 256, *, family: str = "v4-flash", pattern: str = "cycle"
                 ) -> ModelConfig:
    """V4-Flash with `layers` layers (kinds per `pattern`) and `experts` routed experts (V4.1: slice_config41)."""
    if family in V41_FAMILIES:
        return slice_config41(layers, experts, family=family)
    full = full_config_of(family)
    base, overrides = SLICE_FAMILIES[family]
    if not 1 <= layers <= full.n_layers:
        raise ConfigError(f"a {family} slice has 1..{full.n_layers} layers, got {layers}")
    if not 1 <= experts or experts < full.n_activated_experts:
        raise ConfigError(f"a slice needs at least {full.n_activated_experts} experts (top-k), got {experts}")
    if pattern == "model":
        ratios = full.compress_ratios[:layers] + full.compress_ratios[full.n_layers:]
    elif pattern == "cycle":
        kinds = (0, 4, 128)
        ratios = tuple(kinds[i % 3] for i in range(layers)) + full.compress_ratios[full.n_layers:]
    else:
        raise ConfigError(f"slice pattern must be 'model' or 'cycle', got {pattern!r}")
    cfg = preset(base, **overrides, n_layers=layers, compress_ratios=ratios, n_routed_experts=experts,
                 n_hash_layers=min(full.n_hash_layers, layers))
    return cfg.replace(name=f"{family}-slice{layers}x{experts}" + ("" if pattern == "model" else "-cycle"))


def parse_slice(spec: str) -> tuple[str, int, int]:
    """'slice:v4-flash[:LAYERS[:EXPERTS]]' -> (family, layers, experts)."""
    parts = spec.split(":")
    if parts[0] != "slice" or len(parts) < 2 or len(parts) > 4:
        raise ConfigError(f"expected slice:FAMILY[:LAYERS[:EXPERTS]], got {spec!r}")
    try:
        layers = int(parts[2]) if len(parts) > 2 else DEFAULT_SLICE_LAYERS
        experts = int(parts[3]) if len(parts) > 3 else full_config_of(parts[1]).n_routed_experts
    except ValueError:
        raise ConfigError(f"slice layers and experts must be integers, got {spec!r}") from None
    return parts[1], layers, experts


def full_config_of(family: str) -> ModelConfig:
    """The full model of a slice family."""
    if family in V41_FAMILIES:
        return preset(V41_FAMILIES[family][0])
    if family not in SLICE_FAMILIES:
        raise ConfigError(f"no layer slice for {family!r}; slices exist for "
                          f"{', '.join(list(SLICE_FAMILIES) + list(V41_FAMILIES))}")
    base, overrides = SLICE_FAMILIES[family]
    return preset(base, **overrides)


def full_config(cfg: ModelConfig) -> ModelConfig:
    """The full model a slice stands for."""
    return full_config_of(cfg.name.split("-slice")[0])


def slice_model(spec: str, *, kernels: str = "auto", max_seq_len: int = 8192, max_batch: int = 1, seed: int = 0,
                tp: int = 1, numerics: str | None = None, reindex_scope: str = "all"):
    """A `dsjax.Model` of a layer slice with random weights drawn on the first device (`tp` > 1: sharded over the
    first `tp` devices by the sharding rules; the same seed draws the same weights at every degree). numerics: one
    of `dsjax.config.NUMERICS` (default: the config's own); reindex_scope: `ModelConfig.reindex_scope`."""
    from dsjax import sharding
    from dsjax.api import Model, enable_compilation_cache
    from dsjax.bench.device_weights import device_params

    enable_compilation_cache()
    family, layers, experts = parse_slice(spec)
    cfg = slice_config(layers, experts, family=family, pattern="model").replace(kernels=kernels,
                                                                                reindex_scope=reindex_scope)
    cfg = cfg.with_numerics(numerics) if numerics else cfg
    mesh = sharding.make_mesh(tp, 1, jax.devices()[:tp])
    shardings = sharding.param_shardings(cfg, mesh)
    if tp == 1:  # plain single-device arrays, like dsjax.load's
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: one, shardings)
    params = device_params(cfg, shardings, seed=seed)
    where = "the device" if tp == 1 else f"{tp} devices (TP{tp})"
    return Model(cfg, params, source=f"{spec} ({cfg.name}, random weights drawn on {where}, seed {seed})",
                 max_seq_len=max_seq_len, max_batch=max_batch, mesh=mesh if tp > 1 else None)


def state_at(cfg: ModelConfig, batch: int, max_seq: int, position: int, *, with_mtp: bool = False):
    """Empty caches for `batch` rows, every row at `position`: steps timed as if deep into a context (every
    kernel reads the entries a real context that long would have; only their values differ)."""
    return dataclasses.replace(init_state(cfg, batch, max_seq, with_mtp=with_mtp),
                               lengths=jnp.full((batch,), position, jnp.int32))


def chunk_step(cfg: ModelConfig):
    """forward(params, ids, state, n_valid) -> (state, live) of one prefill chunk without the head. `live`, a sum
    of the final stream, keeps every layer whole: a step returning the state alone lets XLA drop the last layer's
    attention and FFN (only the logits read them), so a slice, which stands for interior layers, would time its
    last layer without them."""
    from dsjax.model import forward_hidden_chunk

    def forward(params, ids, state, n_valid=None):
        y, state = forward_hidden_chunk(params, cfg, ids, state, n_valid)
        return state, stream_sum(y)

    return forward


def stream_sum(y):
    """A float32 scalar read from every element of a stream (see `chunk_step`)."""
    return jnp.sum(y.astype(jnp.float32))


def extrapolate_depth(t_shallow: float, t_deep: float, shallow: int, deep: int, full: int) -> tuple[float, float]:
    """(time per layer, full-depth time) from a slice timed at two depths: t is linear in the layers the slices
    add, which repeat what the full model repeats."""
    per_layer = (t_deep - t_shallow) / (deep - shallow)
    return per_layer, t_deep + (full - deep) * per_layer


def proxy_depths(cfg: ModelConfig, shallow: int) -> list[int]:
    """The depths a slice is timed at to extrapolate the full model: V4 `shallow` and all; V4.1 three layers,
    the encoder layers and all (a per-kind fit needs the encoder layer's time apart from the fixed costs)."""
    if cfg.family != "v4.1":
        return [shallow, cfg.n_layers]
    from dsjax.v41_replay import decoder_start

    return sorted({3, decoder_start(cfg), cfg.n_layers})


def full_depth(cfg: ModelConfig, t: dict) -> dict:
    """The full model's time from the slice's times `t` {layers: seconds or ms} at `proxy_depths`: V4 linear in
    the layers (the deeper slice adds layers the full model repeats); V4.1 per layer kind — the encoder layer's
    time from the two encoder-only depths, the decoder layer's from the encoder depth to the whole slice, each
    times the full model's count of that kind beyond the slice's. With no third depth (prefill's two), the
    encoder time is the encoder depth's over its layers: fixed costs (embedding, head) scaled with them, an
    upper bound. Returns {"full", "per_layer", "method"}."""
    full = full_config(cfg)
    L = cfg.n_layers
    if cfg.family != "v4.1":
        L1 = min(t)
        per_layer, total = extrapolate_depth(t[L1], t[L], L1, L, full.n_layers)
        return {"full": total, "per_layer": per_layer,
                "method": f"t(full) = t({L}) + ({full.n_layers} - {L}) x (t({L}) - t({L1})) / {L - L1}"}
    from dsjax.v41_replay import decoder_start

    E, E_full = decoder_start(cfg), decoder_start(full)
    dec = (t[L] - t[E]) / (L - E)
    lower = [d for d in t if d < E]
    if lower:
        L0 = max(lower)
        enc = (t[E] - t[L0]) / (E - L0)
        total = t[L] + (E_full - E) * enc + ((full.n_layers - E_full) - (L - E)) * dec
        method = (f"t(full) = t({L}) + ({E_full} - {E}) x encoder layer + ({full.n_layers - E_full} - {L - E}) x "
                  f"decoder layer; encoder layer = (t({E}) - t({L0})) / {E - L0}, decoder = (t({L}) - t({E})) / {L - E}")
    else:
        enc = t[E] / E
        total = E_full * enc + (full.n_layers - E_full) * dec
        method = (f"t(full) = {E_full} x t({E}) / {E} + {full.n_layers - E_full} x (t({L}) - t({E})) / {L - E} "
                  "(fixed costs scaled with the encoder layers: an upper bound)")
    return {"full": total, "per_layer": {"encoder": enc, "decoder": dec}, "method": method}


def shallower(model, layers: int):
    """The slice's first `layers` layers as a Model sharing its weights (no copy): a second depth for the
    per-layer difference. A V4.1 slice is cut inside its encoder layers (up to its first decoder layer, the
    ratio-1 source; at least the 3 its DSpark reads — which then reads other layers than the deep slice's)."""
    from dsjax.api import Model

    cfg = model.cfg
    family = cfg.name.split("-slice")[0]
    if family in V41_FAMILIES:
        from dsjax.v41_replay import decoder_start

        if not 3 <= layers <= decoder_start(cfg):
            raise ConfigError(f"a shallower V4.1 slice keeps 3 to {decoder_start(cfg)} of its encoder layers "
                              f"(of {cfg.n_layers}), not {layers}")
        sub = slice_config41(layers, cfg.n_routed_experts, family=family)
    else:
        sub = slice_config(layers, cfg.n_routed_experts, family=family, pattern="model")
    sub = sub.replace(kernels=cfg.kernels, reindex_scope=cfg.reindex_scope)
    return Model(sub, dataclasses.replace(model.params, layers=model.params.layers[:layers]),
                 source=f"first {layers} layers of {model.source}", max_seq_len=model.max_seq_len,
                 max_batch=model.max_batch)
