# %% [markdown]
# # Architecture tour: DeepSeek-V4-Flash and V4.1-Flash through dsjax
#
# This notebook walks through the parts of the V4 family that make its long-context decode cheap, using
# dsjax's own functions rather than prose:
#
# 1. **the per-layer schedule** — which layers keep only a sliding window, which compress their KV and how
#    much (CSA, HCA, V4.1's CSA2 sources and readers);
# 2. **shapes through one block** of the real V4-Flash, traced with `jax.eval_shape` (nothing is allocated);
# 3. **KV bytes per layer kind and per token** for V4-Flash vs V4.1-Flash, from `dsjax plan`;
# 4. **what a CSA query attends to** (its window plus the indexer's top-k compressed entries) and **HCA
#    coverage**, run on the `tiny-v4` preset.
#
# The tiny model has random weights: the *structure* of what a query reads (causal, only complete groups,
# exactly k picks, window + compressed entries covering the whole past) is the model's, but *which* entries
# the indexer prefers means nothing until trained weights are loaded. Everything runs on a CPU in seconds.

# %%
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

import dsjax
from dsjax import kv_rows
from dsjax.layers.attention import attention, compressed_visible, project_kv, project_q
from dsjax.layers.compressor import compress_chunk
from dsjax.layers.hyper_connections import hc_pre
from dsjax.layers.indexer import index_queries, index_scores, select_topk
from dsjax.layers.moe import moe
from dsjax.layers.norms import rms_norm
from dsjax.layers.rope import rope_angles
from dsjax.model import block_forward, embed
from dsjax.plan import plan
from dsjax.state import init_state
from dsjax.weights import abstract

V4, V41 = dsjax.preset("v4-flash"), dsjax.preset("v4.1-flash")
print(f"jax {jax.__version__} on {jax.devices()[0].platform}; dsjax {dsjax.__version__}")

# %% [markdown]
# ## 1. The per-layer schedule
#
# Every layer attends to a sliding window of raw KV (`window_size` tokens). What differs is what it adds:
#
# | kind | ratio | adds to the window |
# |---|---|---|
# | `window` | 0 | nothing (the first two layers, and the MTP / DSpark draft layers) |
# | `csa` (V4) | 4 | a lightning indexer scores every compressed entry (one per 4 tokens, overlapping) and the query reads the **top-k** (512 in V4-Flash) |
# | `hca` (V4) | 128 | **every** completed compressed entry (one per 128 tokens), no indexer |
# | `csa2` (V4.1) | 2 or 1 | top-k over a *shared* cache: only a few **KV-source** layers own a compressor; the others reuse a source's cache (and some re-run the indexer over it) |
#
# `ModelConfig.layer_kind` and `layer_rope` are the single source of this schedule; the table below is read
# from them for the two tiny presets (the ones the tests and these notebooks run).

# %%
def schedule(cfg):
    rows = []
    for layer in range(cfg.n_total_layers):
        kind, ratio = cfg.layer_kind(layer), cfg.layer_ratio(layer)
        theta, yarn = cfg.layer_rope(layer)
        if layer >= cfg.n_layers:
            role = "MTP draft" if cfg.family == "v4" else "DSpark stage"
        elif cfg.family == "v4":
            role = "hash-routed MoE" if cfg.layer_uses_hash_routing(layer) else "top-k MoE"
        elif not ratio:
            role = "window only"
        elif layer in cfg.kv_source_layers:
            role = "KV source (owns compressor + index keys)"
        elif layer in cfg.index_source_layers:
            role = f"reindex: own indexer over {max(s for s in cfg.kv_source_layers if s <= layer)}'s keys"
        else:
            role = f"reuse {max(s for s in cfg.kv_source_layers if s <= layer)}'s cache"
        if cfg.family == "v4.1" and layer in cfg.engram_layer_ids:
            role += " + Engram"
        rows.append((layer, kind, ratio, f"{theta:g}{' +YaRN' if yarn else ''}", role))
    return rows


for name in ("tiny-v4", "tiny-v41"):
    cfg = dsjax.preset(name)
    print(f"{name}: window {cfg.window_size}, index top-k {cfg.index_topk}")
    print(f"  {'layer':>5}  {'kind':<7}{'ratio':>5}  {'rope θ':<16}role")
    for layer, kind, ratio, rope, role in schedule(cfg):
        print(f"  {layer:>5}  {kind:<7}{ratio:>5}  {rope:<16}{role}")
    print()

# %% [markdown]
# The full-size models follow the same rules at scale. Each column below is one layer (draft layers at the
# right); colour is the layer kind, the number the compression ratio. V4-Flash alternates CSA (ratio 4) and HCA
# (ratio 128) after two window layers. V4.1-Flash compresses less (ratio 2, then 1) but only **4 of its 40
# layers own a cache**: the hatched layers read the latest source's entries instead of keeping their own —
# which is where V4.1's KV saving in §3 comes from.

# %%
COLORS = {"window": "#bbbbbb", "csa": "#1f77b4", "hca": "#ff7f0e", "csa2": "#2ca02c"}
fig, axes = plt.subplots(2, 1, figsize=(12, 2.8))
for ax, cfg in zip(axes, (V4, V41)):
    for layer in range(cfg.n_total_layers):
        kind, ratio = cfg.layer_kind(layer), cfg.layer_ratio(layer)
        reader = cfg.family == "v4.1" and ratio and layer not in cfg.kv_source_layers
        ax.add_patch(plt.Rectangle((layer, 0), 0.92, 1, color=COLORS[kind], hatch="///" if reader else None,
                                   fill=True, alpha=0.55 if reader else 1.0, lw=0))
        if ratio:
            ax.text(layer + 0.46, 0.5, str(ratio), ha="center", va="center", fontsize=7)
    ax.axvline(cfg.n_layers - 0.04, color="k", lw=1)
    ax.set_xlim(0, cfg.n_total_layers)
    ax.set_yticks([])
    ax.set_ylabel(cfg.name, rotation=0, ha="right", va="center")
    ax.set_xticks(range(0, cfg.n_total_layers, 2))
axes[1].set_xlabel("layer (right of the black line: draft layers)")
handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
handles.append(plt.Rectangle((0, 0), 1, 1, facecolor=COLORS["csa2"], alpha=0.55, hatch="///"))
fig.legend(handles, list(COLORS) + ["csa2 reader (no cache of its own)"], ncol=5, loc="upper center",
           fontsize=8, frameon=False)
fig.tight_layout(rect=(0, 0, 1, 0.86))
plt.show()

# %% [markdown]
# ## 2. Shapes through one block of V4-Flash
#
# A block carries `hc_mult = 4` residual streams (mHC). `hc_pre` collapses them with Sinkhorn-projected mixing
# weights into one input; attention uses a low-rank query (`q_lora_rank`), **one** 512-d KV latent shared by all
# 64 heads (K = V, MQA), and on CSA layers an indexer with its own 64 small heads; `hc_post` spreads the result
# back over the streams. Below, every intermediate of layer 2 (a CSA layer) for a verify block of 6 tokens
# (1 + 5 drafts) against a 4096-token cache — traced with `jax.eval_shape` over the abstract weights, so the
# 160 GB model costs nothing here.

# %%
def block_trace(params, cfg, token_ids, layer, max_seq):
    """Intermediates of `layer` for a chunk at position 0: the block's own functions, in the block's order."""
    B, T = token_ids.shape
    state = init_state(cfg, B, max_seq)
    start, n_valid = state.lengths, jnp.full((B,), T, jnp.int32)
    h = embed(params, cfg, token_ids)
    for l in range(layer):
        h, _ = block_forward(h, token_ids, params.layers[l], cfg, l, state.layers[l], start, n_valid)
    w, st = params.layers[layer], state.layers[layer]
    out = {"01 streams h (mHC)": h}
    x, post, comb = hc_pre(h, w.hc_attn, cfg)
    out["02 hc_pre: mixed input x"], out["03 hc_pre: stream mix comb"] = x, comb
    x = rms_norm(x, w.attn_norm, cfg.norm_eps)
    q_pos = start[:, None] + jnp.arange(T)[None]
    angles = rope_angles(cfg, layer, q_pos)
    q, qr = project_q(x, w.attn, cfg, angles)
    out["04 q latent (low rank)"], out["05 q (all heads)"] = qr, q
    kv = project_kv(x, w.attn, cfg, angles)
    out["06 kv latent (shared, K = V)"], out["07 kv as cached (row)"] = kv, kv_rows.store_main(kv, cfg)
    ratio = cfg.layer_ratio(layer)
    comp = compress_chunk(x, w.attn.compressor, st.compressor, cfg, layer, ratio, start, n_valid)
    out["08 compressed KV cache"] = comp.entries
    iq = index_queries(qr, w.attn.indexer, cfg, angles)
    index = compress_chunk(x, w.attn.indexer.compressor, st.index, cfg, layer, ratio, start, n_valid,
                           index_keys=True)
    out["09 index queries"], out["10 index-key cache"] = iq, index.entries
    scores = index_scores(x, iq, kv_rows.load_index(index.entries, cfg), w.attn.indexer, cfg)
    picks, _ = select_topk(scores, compressed_visible(q_pos, index.entries.shape[1], ratio), cfg.index_topk)
    out["11 index scores"], out["12 top-k picks"] = scores, picks
    o, _, _ = attention(x, w.attn, cfg, layer, st, start, n_valid)
    out["13 attention out"] = o
    out["14 MoE out"] = moe(rms_norm(o, w.ffn_norm, cfg.norm_eps), token_ids, w.ffn, cfg)
    out["15 block out (streams)"] = block_forward(h, token_ids, w, cfg, layer, st, start, n_valid)[0]
    return out


shapes = jax.eval_shape(lambda p, ids: block_trace(p, V4, ids, layer=2, max_seq=4096),
                        abstract(V4), jax.ShapeDtypeStruct((1, 6), jnp.int32))
for name, s in sorted(shapes.items()):
    print(f"{name[3:]:<30} {str(s.shape):<22} {s.dtype}")
assert V4.layer_kind(2) == "csa" and shapes["12 top-k picks"].shape == (1, 6, V4.index_topk)

# %% [markdown]
# Things to notice: the compressed caches are `uint8` rows — 584 bytes for a 512-d main entry (448 FP8 values,
# 7 scale bytes, 64 bf16 rope dims) and 68 bytes for a 128-d index key (packed FP4 + 4 scale bytes) — and
# 4096 / 4 = 1024 of each; the indexer scores all 1024 entries for every query but attention reads only 512 of
# them, plus its window.
#
# ## 3. KV bytes per layer kind and per token: V4-Flash vs V4.1-Flash
#
# `dsjax plan` (`dsjax.plan.plan` from Python) computes, from shapes alone, what the decode state of a
# deployment costs. Its `kv_layout` is the per-token cost of the compressed caches as dsjax allocates them
# (the window rings are a fixed cost per sequence, not per token).

# %%
plans = {cfg.name: plan(cfg.name, tp=8, max_seq_len=65536, batch=8) for cfg in (V4, V41)}
for name, p in plans.items():
    kv = p["kv_layout"]
    print(f"{name}: main row {kv['main_row']['bytes']} B ({kv['main_row']['format']}), "
          f"index row {kv['index_row']['bytes']} B")
    for kind, k in kv["bytes_per_token"].items():
        print(f"  {kind:<24}{k['layers']:>3} layers x (main {k['main']:g} + index {k.get('index', 0):g}) B/token")
    print(f"  total {kv['global_bytes_per_token']:g} B/token -> {kv['global_bytes_per_token'] * 2**20 / 2**30:.2f} "
          f"GiB for a 1M-token sequence; windows {kv['window_bytes_per_sequence'] / 1e6:.2f} MB per sequence\n")

per_token = {name: p["kv_layout"]["global_bytes_per_token"] for name, p in plans.items()}
ratio = per_token["v4-flash"] / per_token["v4.1-flash"]
print(f"V4.1-Flash keeps {1 / ratio:.0%} of V4-Flash's KV bytes per token ({ratio:.2f}x less)")

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 3.6), gridspec_kw={"width_ratios": [1.3, 1]})
bars, x = [], 0
for name, p in plans.items():
    for kind, k in p["kv_layout"]["bytes_per_token"].items():
        per_layer_main, per_layer_index = k["main"], k.get("index", 0)
        ax1.bar(x, per_layer_main, color="#1f77b4")
        ax1.bar(x, per_layer_index, bottom=per_layer_main, color="#9edae5")
        ax1.text(x, per_layer_main + per_layer_index, f"x{k['layers']} layers", ha="center", va="bottom", fontsize=8)
        bars.append(f"{name}\n{kind}")
        x += 1
ax1.set_xticks(range(len(bars)), bars, fontsize=7)
ax1.set_ylabel("bytes per token, one layer")
ax1.set_title("per layer kind (main KV dark, index keys light)", fontsize=10)
for i, (name, p) in enumerate(plans.items()):
    b = 0.0
    for kind, k in p["kv_layout"]["bytes_per_token"].items():
        total = k["layers"] * (k["main"] + k.get("index", 0))
        ax2.bar(i, total, bottom=b, label=f"{name}: {kind}")
        b += total
    ax2.text(i, b, f"{b:,.0f} B/token", ha="center", va="bottom")
ax2.set_xticks(range(2), list(plans))
ax2.set_ylabel("bytes per token, all layers")
ax2.set_title("whole model (stacked by layer kind)", fontsize=10)
ax2.legend(fontsize=7)
fig.tight_layout()
plt.show()

# %% [markdown]
# A V4.1 ratio-2 source costs about as much per layer as a V4 CSA layer (FP4 main rows of 288 bytes instead of
# FP8 rows of 584, at twice the rate), and its ratio-1 source 2x more — but V4.1 keeps **4** such caches where
# V4 keeps 41, so the model as a whole needs about a quarter of the bytes (the tech report's "≈1/4").
#
# ## 4. What a CSA query attends to, and HCA coverage
#
# Now on `tiny-v4` (window 32, CSA ratio 4 with top-8, HCA ratio 16), over a 192-token sequence of random
# token ids. We run the model's own blocks up to the CSA layer 1, then the indexer exactly as `attention` does:
# index queries against the index-key cache, scores masked to the **complete** groups (entry *j* stands for
# tokens 4j .. 4j+3 and becomes visible once token 4j+3 has been seen; ratio-4 entries also pool half their
# channels from the 4 tokens before), top-k.

# %%
tiny = dsjax.load("tiny-v4", max_seq_len=256, max_batch=1)
cfg, S = tiny.cfg, 192
CSA, HCA = 1, 2
assert cfg.layer_kind(CSA) == "csa" and cfg.layer_kind(HCA) == "hca"


@jax.jit
def csa_picks(params, token_ids):
    """(picks [S, k], valid [S, k], scores [S, S/ratio]) of the CSA layer's indexer for every query."""
    B, T = token_ids.shape
    state = init_state(cfg, B, T)
    start, n_valid = state.lengths, jnp.full((B,), T, jnp.int32)
    h = embed(params, cfg, token_ids)
    for l in range(CSA):
        h, _ = block_forward(h, token_ids, params.layers[l], cfg, l, state.layers[l], start, n_valid)
    w, ratio = params.layers[CSA], cfg.layer_ratio(CSA)
    x = rms_norm(hc_pre(h, w.hc_attn, cfg)[0], w.attn_norm, cfg.norm_eps)
    q_pos = start[:, None] + jnp.arange(T)[None]
    angles = rope_angles(cfg, CSA, q_pos)
    iq = index_queries(project_q(x, w.attn, cfg, angles)[1], w.attn.indexer, cfg, angles)
    index = compress_chunk(x, w.attn.indexer.compressor, state.layers[CSA].index, cfg, CSA, ratio, start, n_valid,
                           index_keys=True)
    scores = index_scores(x, iq, kv_rows.load_index(index.entries, cfg), w.attn.indexer, cfg)
    visible = compressed_visible(q_pos, index.entries.shape[1], ratio)
    picks, valid = select_topk(scores, visible, cfg.index_topk)
    return picks[0], valid[0], jnp.where(visible, scores.astype(jnp.float32), jnp.nan)[0]


ids = jnp.asarray(np.random.default_rng(0).integers(2, cfg.vocab_size, (1, S)), jnp.int32)
picks, valid, scores = map(np.asarray, csa_picks(tiny.params, ids))
print(f"picks {picks.shape}: query {S - 1} reads entries {sorted(picks[-1].tolist())}")

# %% [markdown]
# Left: for every query position (row), the tokens its keys come from — the raw **window** (the last 32
# tokens, grey), and the tokens summarised by the **picked compressed entries** (blue: each pick covers 4
# tokens; cyan where a pick overlaps the window). Tokens older than the window that were not picked are not
# read at all. Right: the indexer scores
# behind the picks (white where an entry is not yet complete; the staircase is causality at group granularity).
# Checks: every query picks exactly min(k, complete groups) entries, never an incomplete one. Nothing stops the
# indexer from spending picks on entries its window already holds raw (cyan), as the reference does too; how
# often a trained indexer does so is a question for real weights.

# %%
W, ratio, k = cfg.window_size, cfg.layer_ratio(CSA), cfg.index_topk
reads = np.zeros((S, S), int)      # bit 1: in the window, bit 2: in a picked entry (3: both)
for t in range(S):
    reads[t, max(0, t - W + 1): t + 1] |= 1
    for j in picks[t][valid[t]]:
        reads[t, j * ratio: (j + 1) * ratio] |= 2
    complete = (t + 1) // ratio
    assert valid[t].sum() == min(k, complete) and (picks[t][valid[t]] < complete).all()
in_window = [((j + 1) * ratio > t - W + 1) for t in range(W, S) for j in picks[t][valid[t]]]
print(f"queries past the first window: {np.mean(in_window):.0%} of their picks overlap their own window")

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 5))
cmap = plt.matplotlib.colors.ListedColormap(["white", "#999999", "#1f77b4", "#17becf"])
ax1.imshow(reads, cmap=cmap, vmin=0, vmax=3, interpolation="nearest", aspect="auto")
ax1.set_xlabel("key token position")
ax1.set_ylabel("query position")
ax1.set_title(f"CSA layer {CSA}: window {W} (grey) + top-{k} entries of {ratio} tokens (blue; cyan: both)",
              fontsize=10)
im = ax2.imshow(scores, interpolation="nearest", aspect="auto", cmap="viridis")
tt, kk = np.nonzero(valid)
ax2.scatter(picks[tt, kk], tt, s=1.5, c="red", label="picked")
ax2.set_xlabel("compressed entry j (tokens 4j..4j+3)")
ax2.set_ylabel("query position")
ax2.set_title("indexer scores (random weights); red = top-k", fontsize=10)
ax2.legend(loc="lower left", fontsize=8, markerscale=5)
fig.colorbar(im, ax=ax2, fraction=0.04)
fig.tight_layout()
plt.show()

# %% [markdown]
# **HCA coverage.** An HCA layer needs no indexer: a query at position *t* reads every completed entry
# (entries 0 .. ⌊(t+1)/r⌋ − 1, covering tokens 0 .. r·⌊(t+1)/r⌋ − 1) plus its window. As long as the window
# is at least the ratio (`window_size ≥ r`: 32 ≥ 16 here, 128 ≥ 128 in V4-Flash), the two together cover the
# **whole** past with no gap — the tokens of the group still being filled are always inside the window. The
# plot shows that split for `tiny-v4`'s layer 2 (computed from the same `compressed_visible` mask `attention`
# uses), and checks that nothing is left uncovered.

# %%
r = cfg.layer_ratio(HCA)
q_pos = np.arange(S)
vis = np.asarray(compressed_visible(jnp.asarray(q_pos), S // r, r))          # [S, S/r]
cover = np.zeros((S, S), int)      # bit 1: in the window, bit 2: in a complete entry (3: both)
for t in range(S):
    cover[t, max(0, t - W + 1): t + 1] |= 1
    cover[t, : vis[t].sum() * r] |= 2
    assert (cover[t, : t + 1] > 0).all(), f"query {t} misses part of its past"

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
ax1.imshow(cover, cmap=plt.matplotlib.colors.ListedColormap(["white", "#999999", "#ff7f0e", "#bcbd22"]), vmin=0,
           vmax=3,
           interpolation="nearest", aspect="auto")
ax1.set_xlabel("key token position")
ax1.set_ylabel("query position")
ax1.set_title(f"HCA layer {HCA}: window {W} (grey) + all complete entries of {r} tokens (orange; olive: both)",
              fontsize=9)

# keys a query reads as the context grows, for the full V4-Flash (window 128, CSA top-512 of ratio 4, HCA 128)
ctx = np.unique(np.logspace(0, 20, 400, base=2).astype(int))
Wf, kf = V4.window_size, V4.index_topk
ax2.loglog(ctx, np.minimum(ctx, Wf), label="window layer")
ax2.loglog(ctx, np.minimum(ctx, Wf) + np.minimum(kf, ctx // 4), label="CSA: window + top-512")
ax2.loglog(ctx, np.minimum(ctx, Wf) + ctx // 128, label="HCA: window + all entries")
ax2.loglog(ctx, ctx, "k:", label="dense attention")
ax2.set_xlabel("context length (tokens)")
ax2.set_ylabel("keys read per query")
ax2.set_title("V4-Flash: keys read per query and layer kind", fontsize=10)
ax2.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# At a 1M-token context a V4-Flash query reads 640 keys in a CSA layer (standing for 2,048 + 128 tokens)
# and 8,320 in an HCA layer (covering everything at 128x compression) instead of a million: CSA gives precise
# recall of what the indexer deems relevant, HCA a coarse view of all of it, and alternating the two gives
# every second layer both. That bounded read per query is what keeps decode memory-bound on the *weights*, not
# on the context — which the step-time ablations notebook measures.
