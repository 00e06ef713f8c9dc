# %% [markdown]
# # Step-time ablations: reading `dsjax bench ablate`
#
# `dsjax bench ablate` times the real generation loop on a GPU while it moves one setting at a time away from a
# baseline — kernels, draft length k, steps per dispatch, context, batch — and writes one JSON report per
# sweep (`ablate-<sweep>.json`: the command, machine, JAX version, date, the roofline measured in the same run,
# and every point). This notebook turns those reports into the questions they answer:
#
# 1. **how far each setting is from its floor** — the bytes a step must read over the copy bandwidth;
# 2. **where the floor's bytes go** (weights, experts, KV, LM head, the draft);
# 3. **the host's share** of a step, from the steps-per-dispatch sweep;
# 4. **the full model from a layer slice**: the proxy's per-layer cost, extrapolated to 43 layers;
# 5. **when speculation pays**: tokens/s against draft quality, from the measured decode and verify steps.
#
# It ships with a small real result — `data/ablate-h200-2026-11-30/`, the run recorded in
# `docs/benchmarks.md` (one H200, a 4-layer V4-Flash slice with random weights, batch 1, context 4096, MTP k = 5,
# acceptance *simulated* at α = 0.97) — so it runs anywhere without a GPU. Point `ABLATE_DIR` at your own
# `--out-dir` to read your run; sweeps that are missing are skipped.

# %%
import glob
import json
import os

import matplotlib.pyplot as plt
import numpy as np

ABLATE_DIR = "data/ablate-h200-2026-11-30"  # a `dsjax bench ablate --out-dir` directory

reports = {}
for path in sorted(glob.glob(os.path.join(ABLATE_DIR, "ablate-*.json"))):
    with open(path) as f:
        d = json.load(f)
    reports[d["sweep"]] = d
assert reports, f"no ablate-*.json in {ABLATE_DIR}"

for sweep, d in reports.items():
    roof = d["roofline"]
    print(f"[{sweep}] {d['machine']}, JAX {d['jax']}, {d['date']}; {d['model']}")
print(f"command: {d['command']}")
print(f"roofline (same run): copy {roof['copy_GBps']:,.0f} GB/s, bf16 matmul {roof['matmul_TFLOPs']:,.0f} TFLOP/s")
print(f"baseline: {d['baseline']}")
base = d["baseline"]
COPY = roof["copy_GBps"]  # GB/s, read + write of a device-to-device copy

# %% [markdown]
# ## 1. Every sweep against its floor
#
# For each sweep: the measured ms per step beside the **bandwidth floor** (the bytes the step must read once,
# divided by the copy bandwidth — `dsjax.bench.roofline.step_bytes`/`floor_ms`), and the fraction of the floor
# reached. A point at 100% would be a step that only streams its bytes; the gap is launch and dispatch
# overhead, kernels below bandwidth, and work the floor does not count.

# %%
sweeps = [s for s in ("kernels", "k", "dispatch", "context", "batch") if s in reports]
fig, axes = plt.subplots(1, len(sweeps), figsize=(4.2 * len(sweeps), 3.4), squeeze=False)
for ax, sweep in zip(axes[0], sweeps):
    d = reports[sweep]
    xs = [str(pt[d["axis"]]) for pt in d["points"]]
    ms = [pt["ms_per_step"] for pt in d["points"]]
    floor = [pt.get("floor_ms") or np.nan for pt in d["points"]]
    ax.bar(xs, ms, color="C0", label="measured")
    ax.bar(xs, floor, color="C1", width=0.5, label="bandwidth floor")
    for x, m, f in zip(xs, ms, floor):
        ax.text(x, m, f"{m:.1f} ms\n{f / m:.0%} of floor", ha="center", va="bottom", fontsize=8)
    ax.set_xlabel(d["axis"])
    ax.set_ylabel("ms per step")
    ax.set_ylim(0, max(ms) * 1.3)
    ax.set_title(f"{sweep}: {d['config']}", fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
fig.tight_layout()
plt.show()

# %% [markdown]
# In the shipped sample, the Pallas kernels (`auto` picks them where they were measured faster) **halve** the verify
# step against XLA alone, and `pallas` vs `auto` is within noise — `auto` mixes in XLA only where it won.
# Even so the step is at about a fifth of its floor: most of the time is not spent streaming bytes.
#
# ## 2. Where the floor's bytes go
#
# The floor is a sum of terms (`step_bytes`). Splitting it shows what a faster step would have to read less of.
# In the shipped sample's 4-layer slice the **MTP draft** dominates: 5 drafts each read the LM head (1.06 GB in
# bf16) and the MTP
# block, while 4 layers of backbone are small. At full depth (the proxy's `full_bytes`) the routed experts
# take over — a 6-token verify touches ~34 distinct experts of 256 per layer, not 6.

# %%
def bytes_of(step_bytes):
    """GB per term of a `step_bytes` record."""
    return {k: step_bytes[k] / 1e9 for k in ("dense_weights", "routed_experts", "kv", "head", "draft")}


parts = {}
if "kernels" in reports:
    slice_point = reports["kernels"]["points"][0]
    parts[f"slice, verify {base['k'] + 1}\n({reports['kernels']['config']})"] = bytes_of(slice_point["bytes"])
if "proxy" in reports:
    for row in reports["proxy"]["proxy"]["rows"]:
        parts[f"full {reports['proxy']['proxy']['full_layers']} layers\n{row['step']}"] = bytes_of(row["full_bytes"])

fig, ax = plt.subplots(figsize=(9, 3.6))
labels = list(parts)
left = np.zeros(len(labels))
for i, term in enumerate(("dense_weights", "routed_experts", "kv", "head", "draft")):
    vals = np.array([parts[l][term] for l in labels])
    ax.barh(labels, vals, left=left, color=f"C{i}", label=term.replace("_", " "))
    left += vals
for y, total in enumerate(left):
    ax.text(total, y, f" {total:.1f} GB = {total / COPY * 1e3:.2f} ms at {COPY / 1e3:.2f} TB/s", va="center",
            fontsize=8)
ax.set_xlabel("GB a step must read (the floor = this / copy bandwidth)")
ax.set_xlim(0, left.max() * 1.45)
ax.legend(fontsize=8, ncol=5, loc="upper center", bbox_to_anchor=(0.5, 1.18), frameon=False)
ax.invert_yaxis()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 3. The host's share: steps per dispatch
#
# dsjax runs `steps_per_dispatch` draft–verify steps inside one `lax.while_loop` per device call; the host
# only wakes once per dispatch. With two points, a step costs t(s) = t_device + c / s for s steps per
# dispatch, and the difference gives c, the host's cost of one dispatch (launch, the carry's transfer, the
# Python loop).

# %%
if "dispatch" in reports:
    pts = {pt["steps_per_dispatch"]: pt["ms_per_step"] for pt in reports["dispatch"]["points"]}
    s_lo, s_hi = min(pts), max(pts)
    c = (pts[s_lo] - pts[s_hi]) / (1 / s_lo - 1 / s_hi)
    t_dev = pts[s_hi] - c / s_hi
    print(f"host cost per dispatch c = {c:.2f} ms; device time per step {t_dev:.2f} ms; "
          f"at {s_hi} steps per dispatch the host adds {c / s_hi:.3f} ms per step ({c / s_hi / pts[s_hi]:.1%})")
    s = np.arange(1, 65)
    fig, ax = plt.subplots(figsize=(6, 3.4))
    ax.plot(s, t_dev + c / s, "-", label=f"t = {t_dev:.2f} + {c:.2f} / s  ms")
    ax.plot(list(pts), list(pts.values()), "o", label="measured")
    ax.axhline(t_dev, color="gray", ls=":", label="device time alone")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("steps per dispatch s")
    ax.set_ylabel("ms per step")
    ax.set_ylim(0, None)
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.show()

# %% [markdown]
# With only two measured points the model is fitted, not tested; the `dispatch` sweep's default values
# (1, 8, 32) would give a third point to check it against.
#
# ## 4. From a layer slice to the full model
#
# A full V4-Flash does not fit one H200, so the proxy times two slices of the same random weights — L1 and L2
# layers — and assumes step time is linear in depth, t(L) = t₀ + L·t_layer (t₀: embedding, head, draft, the
# loop). The full model's 43 layers are then an **extrapolation**, labelled as such, compared with the full
# model's own floor.

# %%
if "proxy" in reports:
    px = reports["proxy"]["proxy"]
    L1, L2 = px["layers"]
    Lf = px["full_layers"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.6))
    for i, row in enumerate(px["rows"]):
        t1, t2 = row["slice_ms"][str(L1)], row["slice_ms"][str(L2)]
        per_layer = (t2 - t1) / (L2 - L1)
        t0 = t1 - L1 * per_layer
        assert abs(t0 + Lf * per_layer - row["full_ms_extrapolated"]) < 1e-6 * row["full_ms_extrapolated"]
        L = np.arange(0, Lf + 1)
        ax1.plot(L, t0 + per_layer * L, "--", color=f"C{i}", lw=1)
        ax1.plot([L1, L2], [t1, t2], "o", color=f"C{i}", label=f"{row['step']}: measured slices")
        ax1.plot([Lf], [row["full_ms_extrapolated"]], "*", ms=12, color=f"C{i}",
                 label=f"{Lf} layers (extrapolated) {row['full_ms_extrapolated']:.1f} ms")
        ax1.plot([Lf], [row["full_floor_ms"]], "_", ms=20, mew=2, color=f"C{i}")
        print(f"{row['step']:<28} t0 {t0:5.2f} ms + {per_layer:.3f} ms/layer -> {row['full_ms_extrapolated']:.1f} ms "
              f"(floor {row['full_floor_ms']:.2f} ms, {row['fraction_of_floor']:.0%}); "
              f"{row['full_tokens_per_s_extrapolated']:.0f} tokens/s at acceptance length "
              f"{row['acceptance_length']:.2f}"
              + (" (simulated)" if row["acceptance"] == "simulated" else ""))
    ax1.set_xlabel("layers")
    ax1.set_ylabel("ms per step")
    ax1.set_title("t(L) linear in depth; bars at the right: full-model floors", fontsize=10)
    ax1.legend(fontsize=7)
    names = [row["step"] for row in px["rows"]]
    ax2.bar(names, [row["full_tokens_per_s_extrapolated"] for row in px["rows"]], color=["C0", "C1"])
    ax2.set_ylabel("tokens/s, batch 1 (extrapolated)")
    ax2.set_title("full V4-Flash, one sequence", fontsize=10)
    fig.tight_layout()
    plt.show()

# %% [markdown]
# The intercept t₀ is the part of a step that does not grow with depth. For plain decode it is small; for the
# verify step in the shipped sample it is about 7 ms — mostly the draft, whose 5 MTP passes and LM-head reads
# run one after another
# (§2 showed the draft's bytes; at ~7 ms it also runs far below their floor). On the full model that is a tenth
# of the step, on the 4-layer slice more than half of it: slice timings alone overstate the draft's share.
#
# ## 5. When does speculation pay?
#
# The verify step of k + 1 tokens costs more than a single-token decode step, and it commits on average
# E[L] = (1 − α^{k+1}) / (1 − α) tokens. Speculation wins when E[L] / t_verify > 1 / t_decode. With the
# extrapolated full-model times above, this gives the break-even draft quality; below it, plain decoding is
# faster. (The proxy's verify time includes drafting; its acceptance was simulated, but step time does not
# depend on which tokens are accepted, only on how many.)

# %%
if "proxy" in reports:
    rows = {row["k"]: row for row in reports["proxy"]["proxy"]["rows"]}
    k = max(rows)
    t_dec, t_ver = rows[0]["full_ms_extrapolated"], rows[k]["full_ms_extrapolated"]
    alpha = np.linspace(0, 0.999, 500)
    length = (1 - alpha ** (k + 1)) / (1 - alpha)
    speedup = length * t_dec / t_ver
    even = alpha[np.argmax(speedup >= 1)]
    print(f"k = {k}: verify {t_ver:.1f} ms vs decode {t_dec:.1f} ms -> needs E[L] > {t_ver / t_dec:.2f}, "
          f"i.e. α > {even:.2f}; at α = {base['alpha']} speculation gives "
          f"{np.interp(base['alpha'], alpha, speedup):.2f}x")
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    ax.plot(alpha, 1e3 * length / t_ver, label=f"speculative, k = {k} (extrapolated step time)")
    ax.axhline(1e3 / t_dec, color="k", ls="--", label="plain decode")
    ax.axvline(even, color="gray", ls=":")
    ax.axvline(base["alpha"], color="C3", ls=":", label=f"α = {base['alpha']} (simulated in the run)")
    ax.set_xlabel("per-draft acceptance α")
    ax.set_ylabel("tokens/s, batch 1")
    ax.set_title(f"full V4-Flash from the slice proxy: break-even at α ≈ {even:.2f}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.show()

# %% [markdown]
# Both steps are far from their floors (9–12%), so these ratios describe today's implementation, not the
# hardware: a verify step closer to its floor would move the break-even left. The `k`, `context` and `batch`
# sweeps (not in the shipped sample) answer the neighbouring questions — how t_verify grows with k, with the
# KV a query reads, and with the distinct experts a batch touches — and this notebook plots them as soon as
# their JSON files are in `ABLATE_DIR`.
