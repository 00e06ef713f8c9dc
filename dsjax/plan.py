"""Memory planner: per-device bytes of weights, decode state and workspace on a (dp, tp) mesh, and whether that
fits a GPU under JAX's memory policy — computed from shapes alone, so it runs on a laptop for the 160 GB model.

Weights come from `weights.describe` and the sharding rules (bytes / mesh sizes of each array's PartitionSpec),
state from `jax.eval_shape(init_state(...))` with the batch slots one data-parallel shard holds, and the
workspace from a stated formula over the XLA path's largest temporaries (an estimate, not a measurement).
"""

from __future__ import annotations

import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh

from dsjax import kv_rows, sharding
from dsjax.config import ModelConfig
from dsjax.errors import ConfigError

PREFILL_CHUNK = 256   # generate.GenerateOptions.prefill_chunk
VERIFY_TOKENS = 3     # a decode step with MTP and 2 drafts runs 3 tokens (plain decode: 1)
DEFAULT_MEM_FRACTION = 0.75  # JAX's default XLA_PYTHON_CLIENT_MEM_FRACTION (of the device's total memory)

# total device memory in bytes, and where the figure comes from
GPUS = {
    "H200": (150_109_880_320, "measured here: CUDA total of an H200 (nvidia-smi 143,771 MiB); JAX 0.11.2's "
                              "bytes_limit there is 112,583,507,968 at the default fraction 0.75"),
    "B200": (183_359 * 2**20, "assumed, not measured: nvidia-smi's 183,359 MiB (datasheet 180 GB; 192 GB physical)"),
    "B300": (288 * 10**9, "assumed, not measured: datasheet 288 GB HBM3e, read as 10^9 bytes"),
}

CATEGORIES = ("attention", "indexer", "compressors", "router", "routed experts", "shared expert",
              "embedding", "head", "mHC + norms", "MTP", "Engram tables", "Engram projections", "DSpark", "vision")


_ROUTED = re.compile(r"\.ffn\.w[123]\.")


def _category(path: str, family: str = "v4") -> str:
    if path.startswith((".vision", ".aligner", ".image_")):
        return "vision"
    if path.startswith(".mtp"):
        return "DSpark" if family == "v4.1" else "MTP"
    if ".engram.embed." in path:
        return "Engram tables"
    if ".engram." in path:
        return "Engram projections"
    if path.startswith(".embed"):
        return "embedding"
    if path.startswith(".head"):
        return "head"
    for part, cat in ((".attn.indexer.", "indexer"), (".attn.compressor.", "compressors"), (".attn.", "attention"),
                      (".ffn.shared_", "shared expert")):
        if part in path:
            return cat
    if _ROUTED.search(path):
        return "routed experts"
    return "router" if ".ffn." in path else "mHC + norms"


def mem_policy(mem_fraction: float | None = None) -> dict:
    """The share of device memory XLA's allocator may use: the argument, else XLA_PYTHON_CLIENT_MEM_FRACTION,
    else 0.75; the platform allocator has no pool and no cap."""
    env = os.environ
    allocator = env.get("XLA_PYTHON_CLIENT_ALLOCATOR", "default")
    source = "argument"
    if mem_fraction is None:
        raw = env.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
        source = "XLA_PYTHON_CLIENT_MEM_FRACTION" if raw else "JAX default"
        try:
            mem_fraction = float(raw) if raw else DEFAULT_MEM_FRACTION
        except ValueError:
            raise ConfigError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={raw!r} is not a number") from None
    if allocator == "platform":
        mem_fraction, source = 1.0, "XLA_PYTHON_CLIENT_ALLOCATOR=platform (no pool, no cap)"
    if not 0 < mem_fraction <= 1:
        raise ConfigError(f"memory fraction must lie in (0, 1], got {mem_fraction}")
    return {"mem_fraction": mem_fraction, "source": source, "allocator": allocator,
            "preallocate": env.get("XLA_PYTHON_CLIENT_PREALLOCATE", "true")}


def _rules(ep, tp: int, dp: int) -> sharding.ShardingRules:
    if isinstance(ep, int) or (isinstance(ep, str) and ep.isdigit()):
        n = int(ep)
        if n == tp:
            ep = "tp"
        elif n == tp * dp:
            ep = "all"
        else:
            raise ConfigError(f"--ep {n}: experts split over the tp devices ({tp}) or over all devices "
                              f"({dp * tp}); choose one of those, or 'tp' / 'all'")
    return sharding.rules_for(ep)


def _valid_tp(tree, rules, limit: int = 256) -> list[int]:
    """tp degrees that divide every dimension the rules split over `tp` (for the error message)."""
    from dsjax.weights import is_info
    g = 0
    for info in jax.tree.leaves(tree, is_leaf=is_info):
        for dim, logical in zip(info.shape, info.axes):
            if "tp" in rules.mesh_axes(logical):
                g = math.gcd(g, dim)
    return [t for t in range(1, min(g, limit) + 1) if g % t == 0]


def weight_plan(cfg: ModelConfig, mesh) -> dict:
    """Per-device bytes by category, global bytes, logical parameter counts, largest dense dequantised weight."""
    from dsjax.weights import describe, is_info
    tree = describe(cfg)
    rules, sizes = cfg.sharding, dict(zip(mesh.axis_names, mesh.axis_sizes))
    per_device = dict.fromkeys(CATEGORIES, 0)
    total = backbone = mtp = engram = vision = dense_elems = 0
    devices = sizes["dp"] * sizes["tp"]
    for path, info in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_info)[0]:
        key = jax.tree_util.keystr(path)
        cat = _category(key, cfg.family)
        full = math.prod(info.shape) * np.dtype(info.dtype).itemsize
        if cat == "Engram tables":  # rows split over every device, the last shard padded (the reference's layout)
            per_device[cat] += -(-info.shape[0] // devices) * (full // info.shape[0])
            total += full
            engram += math.prod(info.shape) if info.logical_shape or info.dtype != jnp.uint8 else 0
            continue
        spec = rules.spec(info.axes)
        try:
            sharding.check_divisible(info.shape, spec, mesh, key)
        except ConfigError as e:
            raise ConfigError(f"{cfg.name}, dp={sizes['dp']} tp={sizes['tp']}: {e} (tp values that divide every "
                              f"tp-split dimension: {', '.join(map(str, _valid_tp(tree, rules)))})") from None
        split = math.prod(sizes[a] for part in spec if part for a in ((part,) if isinstance(part, str) else part))
        per_device[cat] += full // split
        total += full
        if info.logical_shape or not jnp.issubdtype(info.dtype, jnp.integer):  # not scales, not tid2eid
            n = math.prod(info.logical_shape or info.shape)
            if cat == "vision":
                vision += n
            else:
                mtp, backbone = (mtp + n, backbone) if cat in ("MTP", "DSpark") else (mtp, backbone + n)
        if info.logical_shape and np.dtype(info.dtype).itemsize == 1 and not _ROUTED.search(key):
            dense_elems = max(dense_elems, math.prod(info.logical_shape) // split)  # FP8 Linear, dequantised per matmul
    return {"per_device": per_device, "per_device_total": sum(per_device.values()), "global_total": total,
            "logical_params": {"backbone": backbone, "mtp": mtp, "engram": engram, "vision": vision,
                               "total": backbone + mtp + engram + vision},
            "largest_dense_elems": dense_elems}


def state_plan(cfg: ModelConfig, batch: int, max_seq_len: int) -> dict:
    """Bytes of the decode state of `batch` slots (with the MTP ring), by kind, from `init_state`'s shapes
    (V4.1: `init_state41`: KV sources' caches, Engram token history; no DSpark rings yet)."""
    if cfg.family == "v4.1":
        from dsjax.v41_state import init_state41
        shapes = jax.eval_shape(lambda: init_state41(cfg, batch, max_seq_len))
    else:
        from dsjax.state import init_state
        shapes = jax.eval_shape(lambda: init_state(cfg, batch, max_seq_len, with_mtp=True))
    out = dict.fromkeys(("window rings", "compressed main KV", "index keys", "compressor buffers", "lengths"), 0)
    for path, x in jax.tree_util.tree_flatten_with_path(shapes)[0]:
        key, n = jax.tree_util.keystr(path), x.size * x.dtype.itemsize
        kind = ("window rings" if key.endswith(".window") else "lengths" if key == ".lengths" else
                "Engram history" if key == ".engram_history" else
                "index keys" if ".index.entries" in key or key.endswith(".index_keys") else
                "compressed main KV" if key.endswith(".entries") else "compressor buffers")
        out.setdefault(kind, 0)
        out[kind] += n
    return {"per_device": out, "per_device_total": sum(out.values())}


def kv_layout(cfg: ModelConfig) -> dict:
    """Cache rows as `init_state` allocates them, and KV bytes per token per layer kind and in total."""
    dt = np.dtype(cfg.compute_dtype).itemsize
    if cfg.family == "v4.1":
        return _v41_kv_layout(cfg, dt)
    main_c, idx_c = kv_rows.main_rows_compact(cfg), kv_rows.index_rows_compact(cfg)
    main = kv_rows.main_row_bytes(cfg) if main_c else cfg.head_dim * dt
    idx = kv_rows.index_row_bytes(cfg) if idx_c else cfg.index_head_dim * dt
    kinds: dict[str, dict] = {}
    for layer in range(cfg.n_layers):
        kind, ratio = cfg.layer_kind(layer), cfg.layer_ratio(layer)
        if not ratio:
            continue
        k = kinds.setdefault(f"{kind} (ratio {ratio})", {"layers": 0, "main": main / ratio})
        k["layers"] += 1
        if kind == "csa":
            k["index"] = idx / ratio
    total = sum(k["layers"] * (k["main"] + k.get("index", 0)) for k in kinds.values())
    return {"main_row": {"bytes": main, "format": "compact uint8 (448 e4m3 + 7 ue8m0 + 64 bf16 rope, padded)"
                         if main_c else f"{cfg.compute_dtype} values"},
            "index_row": {"bytes": idx, "format": "compact uint8 (packed e2m1 + ue8m0 per 32)"
                          if idx_c else f"{cfg.compute_dtype} values"},
            "bytes_per_token": kinds, "global_bytes_per_token": total,
            "window_bytes_per_sequence": (cfg.n_layers + cfg.n_mtp_layers) * cfg.window_size * main}


def workspace(cfg: ModelConfig, mesh, slots: int, max_seq_len: int, dense_elems: int) -> dict:
    """Estimated peak temporaries of one device on the XLA path: the larger of a prefill chunk (T = 256) and a
    decode step (T = 3, MTP verify), each 1.05 x (slack for buffers the terms leave out)

      B·T·V·4 logits (f32, a program output) [+ Vfull·D·4 the head cast to f32, prefill only, counted unsharded]
      + 3·B·T·n·D·4 mHC streams + the largest FP8 dense weight dequantised (compute dtype)
      + max(attention, MoE) of the largest layer:
        attention = B·T·(W+K)·(d·dt + row) keys + 2·B·T·H·(W+K)·4 logits/probs
                    [+ B·T·Hidx·(L/4)·4 indexer scores, CSA]; K = top-k (CSA) or L/ratio (HCA)
        MoE, rows ≥ E (grouped): rows·E·D·dt (ragged_dot's masked operand on GPU) + 2·E·I·D·dt (w1 and w3
                    dequantised, the whole local stacks); rows < E (gather): rows·I·D·dt; both + rows·(4·D + 12·I)
                    activations, rows = B·T·top-k (tokens all-gathered when experts span dp).
    H, Hidx, V, E are per-device shares. Checked against measured peaks of a 4-layer V4-Flash on H200s (JAX
    0.11.2, tp 1 and 2, see docs/plan.md): the estimate was 4-25% above them, never below.
    """
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    rules = cfg.sharding

    def share(n, logical):
        return n // math.prod(sizes[a] for a in rules.mesh_axes(logical))

    B, L, dt = slots, max_seq_len, np.dtype(cfg.compute_dtype).itemsize
    n, D, d, W, I, k = cfg.hc_mult, cfg.dim, cfg.head_dim, cfg.window_size, cfg.moe_inter_dim, cfg.n_activated_experts
    H, IH = share(cfg.n_heads, "heads"), share(cfg.index_n_heads, "index_heads")
    V, E = share(cfg.vocab_size, "vocab"), share(cfg.n_routed_experts, "experts")
    row = kv_rows.main_row_bytes(cfg) if kv_rows.main_rows_compact(cfg) else d * dt
    token_gather = math.prod(sizes[a] for a in rules.mesh_axes("batch") if a in rules.mesh_axes("experts"))

    def step(T, prefill):
        attn = 0
        for ratio in {cfg.layer_ratio(i) for i in range(cfg.n_layers)}:
            topk = ratio == 4 or (cfg.family == "v4.1" and ratio > 0)  # V4.1: every compressed layer picks top-k
            K = min(cfg.index_topk, L // ratio) if topk else (L // ratio if ratio else 0)
            a = B * T * (W + K) * (d * dt + row) + 2 * B * T * H * (W + K) * 4
            attn = max(attn, a + (B * T * IH * (L // ratio) * 4 if topk else 0))
        rows = B * T * k * token_gather
        experts = rows * E * D * dt + 2 * E * I * D * dt if rows >= E else rows * I * D * dt
        moe = experts + rows * (4 * D + 12 * I)
        fixed = B * T * V * 4 + (cfg.vocab_size * D * 4 if prefill else 0) + 3 * B * T * n * D * 4 + dense_elems * dt
        return int(1.05 * (fixed + max(attn, moe))), ("attention" if attn >= moe else "MoE")

    phases = {}
    for name, T, prefill in (("prefill chunk", min(PREFILL_CHUNK, L), True), ("decode step", VERIFY_TOKENS, False)):
        total, part = step(T, prefill)
        phases[f"{name} ({part})"] = total
    peak = max(phases, key=phases.get)
    return {"per_device": phases[peak], "phase": peak, "phases": phases,
            "formula": workspace.__doc__.strip()}


def _load(cfg_or_preset, numerics: str | None) -> ModelConfig:
    if isinstance(cfg_or_preset, ModelConfig):
        cfg = cfg_or_preset
    else:       # whatever `dsjax.load` takes: a checkpoint, Orbax or bundled directory, a config.json, a preset
        from dsjax.api import model_config
        cfg = model_config(cfg_or_preset)
    return cfg.with_numerics(numerics) if numerics else cfg


def _v41_kv(cfg: ModelConfig) -> dict:
    """V4.1 KV bytes/token from the spec (§4.2): each KV-source layer keeps 288-B FP4 main rows and 68-B index
    rows per compressed entry; the other layers read their source's cache."""
    per = sum((288 + 68) / cfg.layer_ratio(s) for s in cfg.kv_source_layers)
    return {"global_bytes_per_token": per, "source": "model spec §4.2 (paper layout; not what dsjax allocates)"}


def _v41_kv_layout(cfg: ModelConfig, dt: int) -> dict:
    """V4.1 caches as `init_state41` allocates them (`v41_rows`: 288-B FP4 main rows, 68-B index rows, 528-B FP8
    window rows for the reference presets; compute-dtype values otherwise), at the KV sources only; Reuse and
    Reindex layers read their source's."""
    from dsjax import v41_rows
    rows = v41_rows.row_shapes(cfg)
    width = {k: w * np.dtype(t).itemsize for k, (w, t) in rows.items()}
    main, idx = width["main"], width["index"]
    kinds: dict[str, dict] = {}
    for layer in cfg.kv_source_layers:
        ratio = cfg.layer_ratio(layer)
        k = kinds.setdefault(f"csa2 source (ratio {ratio})", {"layers": 0, "main": main / ratio, "index": idx / ratio})
        k["layers"] += 1
    fmt = f"{cfg.compute_dtype} values"
    return {"main_row": {"bytes": main, "format": "compact uint8 (packed e2m1 + e4m3 per 16)"
                         if v41_rows.compact(cfg) else fmt},
            "index_row": {"bytes": idx, "format": "compact uint8 (packed e2m1 + ue8m0 per 32)"
                          if v41_rows.index_compact(cfg) else fmt},
            "bytes_per_token": kinds,
            "global_bytes_per_token": sum(k["layers"] * (k["main"] + k["index"]) for k in kinds.values()),
            "paper_bytes_per_token": _v41_kv(cfg)["global_bytes_per_token"],
            # what SGLang / vLLM keep for V4.1 today: 584-B fp8_ds_mla main rows + 68-B index rows (spec §4.2)
            "engines_bytes_per_token": sum((584 + 68) / cfg.layer_ratio(s) for s in cfg.kv_source_layers),
            "window_bytes_per_sequence": cfg.n_layers * cfg.window_size * width["window"]}


def plan(cfg_or_preset, tp: int = 1, dp: int = 1, ep="tp", max_seq_len: int = 4096, batch: int = 8, *,
         numerics: str | None = None, mem_fraction: float | None = None, gpus=tuple(GPUS)) -> dict:
    """Per-device memory of serving `batch` sequences of up to `max_seq_len` tokens on a dp x tp mesh.

    `ep`: routed experts over "tp" (default), "all" devices, or an int equal to tp or dp*tp. Nothing is
    allocated. Returns plain JSON values (bytes as ints); `format_plan` renders them as a table."""
    cfg = _load(cfg_or_preset, numerics)
    if not (isinstance(tp, int) and isinstance(dp, int) and tp >= 1 and dp >= 1):
        raise ConfigError(f"tp and dp must be positive ints, got tp={tp!r} dp={dp!r}")
    if not 2 <= max_seq_len <= cfg.max_position_embeddings:
        raise ConfigError(f"max_seq_len {max_seq_len} must lie in [2, {cfg.max_position_embeddings}] for {cfg.name}")
    if batch < 1:
        raise ConfigError(f"batch must be ≥ 1, got {batch}")
    rules = _rules(ep, tp, dp)
    cfg = cfg.replace(sharding=rules)
    slots = max(1 << (batch - 1).bit_length(), dp)  # generate.stream buckets the batch to a power of two, ≥ dp
    if slots % dp:
        raise ConfigError(f"{slots} batch slots (batch {batch} rounded up to a power of two) do not split over dp={dp}")
    policy = mem_policy(mem_fraction)
    out = {"model": cfg.name, "family": cfg.family, "numerics": cfg.numerics,
           "mesh": {"dp": dp, "tp": tp, "devices": dp * tp, "experts_over": list(rules.experts)},
           "batch": batch, "batch_slots": slots, "slots_per_device": slots // dp, "max_seq_len": max_seq_len,
           "memory_policy": policy, "notes": []}
    mesh = AbstractMesh((dp, tp), sharding.MESH_AXES)
    w = weight_plan(cfg, mesh)
    st = state_plan(cfg, slots // dp, max_seq_len)
    ws = workspace(cfg, mesh, slots // dp, max_seq_len, w.pop("largest_dense_elems"))
    total = w["per_device_total"] + st["per_device_total"] + ws["per_device"]
    fits = []
    for name in gpus:
        mem, source = GPUS[name]
        budget = int(mem * policy["mem_fraction"])
        fits.append({"gpu": name, "total_bytes": mem, "budget_bytes": budget, "fits": total <= budget,
                     "headroom_bytes": budget - total, "source": source})
    out.update(weights=w, state=st, kv_layout=kv_layout(cfg), workspace=ws, per_device_total=total, gpus=fits)
    if cfg.family == "v4.1":
        out["notes"] += [
            f"Engram tables counted with their rows split over all {dp * tp} devices (ceil, as the reference pads "
            f"its last shard); dsjax's lookup still holds them whole per device (the sharded lookup is not written)",
            f"KV caches as allocated: {kv_layout(cfg)['global_bytes_per_token']:g} B/token (the paper's packed "
            f"layout: {kv_layout(cfg)['paper_bytes_per_token']:g} B/token, spec §4.2)",
            "DSpark weights included; its decode state (3 window rings) is not allocated yet"]
    out["notes"] += [
        "weights as dsjax holds them: wo_a dequantised to bf16 (FP8 in the checkpoint), tid2eid int32 (int64)",
        f"workspace is an estimate of the XLA path's largest temporaries ({ws['phase']}), not a measurement",
        "XLA_PYTHON_CLIENT_PREALLOCATE=false changes when the pool is taken, not its cap "
        "(bytes_limit measured unchanged on an H200)"]
    return out


def _gb(n) -> str:
    return f"{'< 0.01':>9} GB" if 0 < n < 5e6 else f"{n / 1e9:9.2f} GB"


def format_plan(p: dict) -> str:
    """The plan as a readable table (GB = 10^9 bytes)."""
    m = p["mesh"]
    lines = [f"{p['model']} ({p['numerics']}) on dp={m['dp']} x tp={m['tp']} = {m['devices']} device(s), "
             f"experts over {'x'.join(m['experts_over'])}",
             f"batch {p['batch']} -> {p['batch_slots']} slots ({p['slots_per_device']} per device), "
             f"max_seq_len {p['max_seq_len']}", ""]
    if p["weights"] is None:
        lines += [f"note: {n}" for n in p["notes"]]
        lines.append(f"KV bytes/token (spec): {p['kv_layout']['global_bytes_per_token']:g}")
        return "\n".join(lines)
    w, st, ws, kv = p["weights"], p["state"], p["workspace"], p["kv_layout"]
    lp = {k: v / 1e9 for k, v in w["logical_params"].items()}
    draft = "DSpark" if p["family"] == "v4.1" else "MTP"
    engram = f" + {lp['engram']:.2f}B Engram tables" if lp.get("engram") else ""
    vision = f" + {lp['vision']:.2f}B vision" if lp.get("vision") else ""
    lines.append(f"parameters: {lp['backbone']:.2f}B backbone + {lp['mtp']:.2f}B {draft}{engram}{vision} = "
                 f"{lp['total']:.2f}B")
    lines.append("per device (GB = 10^9 bytes)")
    lines.append(f"weights{'':<27}{_gb(w['per_device_total'])}   (all devices hold {_gb(w['global_total']).strip()})")
    lines += [f"  {c:<32}{_gb(b)}" for c, b in w["per_device"].items() if b]
    lines.append(f"decode state{'':<22}{_gb(st['per_device_total'])}")
    lines += [f"  {c:<32}{_gb(b)}" for c, b in st["per_device"].items() if b]
    lines.append(f"workspace (estimate){'':<14}{_gb(ws['per_device'])}")
    lines += [f"  {c:<32}{_gb(b)}" for c, b in ws["phases"].items()]
    lines.append(f"{'total':<34}{_gb(p['per_device_total'])}")
    lines.append("")
    lines.append(f"KV rows: main {kv['main_row']['bytes']} B ({kv['main_row']['format']}), "
                 f"index {kv['index_row']['bytes']} B ({kv['index_row']['format']})")
    for kind, k in kv["bytes_per_token"].items():
        idx = f" + index {k['index']:g}" if "index" in k else ""
        lines.append(f"  {kind:<18} {k['layers']:>3} layers x (main {k['main']:g}{idx}) B/token")
    lines.append(f"  global {kv['global_bytes_per_token']:g} B/token per sequence; windows "
                 f"{kv['window_bytes_per_sequence'] / 1e6:.2f} MB per sequence")
    if "engines_bytes_per_token" in kv:
        e = kv["engines_bytes_per_token"]
        lines.append(f"  engines today (SGLang, vLLM: 584-B fp8_ds_mla main + 68-B index rows): {e:g} B/token — "
                     f"dsjax keeps {kv['global_bytes_per_token'] / e:.0%} of it ({e / kv['global_bytes_per_token']:.2f}x "
                     "the sequences per GB of KV cache)")
    pol = p["memory_policy"]
    lines.append("")
    lines.append(f"fits? budget = {pol['mem_fraction']:g} x device memory ({pol['source']}; "
                 f"preallocate={pol['preallocate']})")
    for g in p["gpus"]:
        verdict = "fits" if g["fits"] else "DOES NOT FIT"
        lines.append(f"  {g['gpu']:<5} budget {_gb(g['budget_bytes'])}  {verdict:<13} headroom "
                     f"{_gb(g['headroom_bytes'])}")
    lines.append("")
    lines += [f"note: {n}" for n in p["notes"]]
    return "\n".join(lines)
