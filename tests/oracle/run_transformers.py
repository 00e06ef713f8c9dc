#!/usr/bin/env python
"""Causal fp32 logits from transformers' ``DeepseekV4ForCausalLM`` (the V4 exactness oracle) -> .npz.

Run with the oracle venv (``tests/oracle/build_venv.sh``), never with the JAX venv::

    .oracle-venv/bin/python tests/oracle/run_transformers.py --model-dir DIR --ids ids.npy --out out.npz \
        [--greedy N] [--positions 0,5,79 | all | none] [--prefill 1] [--atol 1e-4] [--topk stable|native]

DIR: config.json + model.safetensors in transformers layout (as ``save_pretrained`` writes them, see
dsjax/transformers_layout.py). An OFFICIAL-layout dir (FP8/FP4, ``compress_ratios``) is converted on the fly
(numpy dequantisation) into ``--convert-dir`` (default: a temp dir).

Top-k (``--topk``, default ``stable``): transformers' one-shot forward is not causal at some positions with
torch's own top-k (docs/transformers-oracle.md §9). The cause is tie-breaking, not information flow: a CSA
indexer score is exactly 0.0 whenever ReLU zeroes every index head, so several compressed entries can tie at
the top-k boundary, and torch.topk (CPU) resolves such ties differently depending on the row it sees, which
includes masked (-inf) future entries in a longer forward. ``stable`` replaces torch.topk / Tensor.topk with
a stable sort (equal values -> lower index first, = jax.lax.top_k and the goldens' rule H-1); then the
full forward, every prefix forward and the cached decode agree to ~1e-5. ``native`` keeps torch's choice
(reproduces the non-causality; the two causal methods below may then disagree after a tie).

Two causal methods, which must agree (checked in ``stable`` mode):
  * ``cache``  : prefill ids[:, :prefill] then feed one token at a time with the model's own cache
                 (DeepseekV4CSACache / HCACache); the logits of step p are position p's.
  * ``prefix`` : last-position logits of a cache-free forward over ids[:, :p+1], at ``--positions``.
Outputs (all float32 unless noted):
  logits_causal [b, s, V]        from the cached decode (positions < prefill-1 from the prefix method)
  logits_prefix [b, P, V], positions [P] (int32)
  logits_full_forward [b, s, V]  plain one-shot ``model(ids, use_cache=False)``
  full_minus_causal_maxabs [b, s]
  indexer_boundary_ties [L_csa] (int32)  cached-decode indexer rows whose k-th and (k+1)-th scores are equal
  topk_mode (str), ids [b, s] (int32)
  greedy_tokens [b, N] (int32), greedy_logits [b, N, V]  (--greedy N) greedy continuation with the cache;
                                 greedy_logits[:, k] is the distribution greedy_tokens[:, k] was argmaxed from
                                 (k = 0: the last prompt position), the goldens' decode_tokens convention.
Exits 1 if the load report shows missing/unexpected/mismatched keys, or (stable mode) the methods disagree.
"""
import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_layout():
    """Import dsjax/transformers_layout.py by path (the dsjax package may import jax)."""
    spec = importlib.util.spec_from_file_location("transformers_layout",
                                                  os.path.join(REPO, "dsjax", "transformers_layout.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def use_stable_topk():
    """Make torch.topk / Tensor.topk break ties toward the lower index (stable descending sort)."""
    def stable_topk(x, k, dim=-1, largest=True, sorted=True):
        v, i = torch.sort(x, dim=dim, descending=largest, stable=True)
        return torch.return_types.topk((v.narrow(dim, 0, k), i.narrow(dim, 0, k)))

    torch.Tensor.topk = stable_topk
    torch.topk = stable_topk


def count_indexer_ties(model):
    """Hook every indexer scorer; in decode (one query, all entries visible) count top-k boundary ties."""
    counts = []
    for layer in model.model.layers:
        comp = getattr(layer.self_attn, "compressor", None)
        if comp is None or not hasattr(comp, "indexer"):
            continue
        counts.append(0)
        k, j = comp.indexer.index_topk, len(counts) - 1

        def hook(mod, args, out, k=k, j=j):
            if out.shape[1] == 1 and out.shape[-1] > k:
                v = torch.sort(out[:, 0], dim=-1, descending=True).values
                counts[j] += int((v[:, k - 1] == v[:, k]).sum())

        comp.indexer.scorer.register_forward_hook(hook)
    return counts


def is_official_dir(d):
    cfg = json.load(open(os.path.join(d, "config.json")))
    return "compress_ratios" in cfg or "quantization_config" in cfg or "dim" in cfg


def load_model(model_dir):
    from transformers import DeepseekV4ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # e.g. the harmless YaRN "factor != max_pos/original" warning
    hf_logging.disable_progress_bar()

    model, info = DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=torch.float32, output_loading_info=True)
    report = {k: sorted(v) if isinstance(v, (set, list)) else v for k, v in info.items()}
    print("load report:", json.dumps({k: (len(v), v[:5]) for k, v in report.items()}))
    if any(report[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs") if k in report):
        sys.exit("load report not clean")
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params}, layer_types {model.config.layer_types}, mlp {model.config.mlp_layer_types}")
    return model.eval()


@torch.no_grad()
def logits_of(model, ids, **kw):
    return model(input_ids=ids, **kw).logits.float()


@torch.no_grad()
def cached_decode(model, ids, prefill, greedy):
    """Prefill ids[:, :prefill], then one token per step; returns per-position logits and greedy data."""
    from transformers import DynamicCache

    b, s = ids.shape
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids[:, :prefill], cache=cache, use_cache=True)
    cache = out.cache
    steps = [out.logits[:, -1].float()]
    for p in range(prefill, s):
        out = model(input_ids=ids[:, p : p + 1], cache=cache, use_cache=True)
        cache = out.cache
        steps.append(out.logits[:, -1].float())
    g_tok, g_log = [], []
    last = steps[-1]
    for _ in range(greedy):
        tok = last.argmax(-1)
        g_tok.append(tok)
        g_log.append(last)
        out = model(input_ids=tok[:, None], cache=cache, use_cache=True)
        cache = out.cache
        last = out.logits[:, -1].float()
    return torch.stack(steps, 1), g_tok, g_log


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--ids", required=True, help=".npy int array [b, s] (or [s])")
    ap.add_argument("--out", required=True)
    ap.add_argument("--greedy", type=int, default=0)
    ap.add_argument("--positions", default="all", help="positions for the prefix method: 'all', 'none', or a,b,c")
    ap.add_argument("--prefill", type=int, default=1, help="tokens in the cached-decode prefill (>=1)")
    ap.add_argument("--atol", type=float, default=1e-4, help="max |cache - prefix| allowed")
    ap.add_argument("--convert-dir", default=None, help="where to put an official dir's converted copy")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--topk", choices=["stable", "native"], default="stable",
                    help="stable: ties -> lower index (jax.lax.top_k); native: torch's own choice")
    args = ap.parse_args()
    if args.topk == "stable":
        use_stable_topk()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    t = {"start": time.time()}
    if is_official_dir(args.model_dir):
        with tempfile.TemporaryDirectory(prefix="v4_hf_") as tmp:
            model_dir = args.convert_dir or tmp
            n = len(load_layout().convert_official_dir(args.model_dir, model_dir))
            print(f"official layout: converted {n} tensors (numpy-dequantised fp32) -> {model_dir}")
            model = load_model(model_dir)  # reads everything before the temp dir goes
    else:
        model = load_model(args.model_dir)
    t["load"] = time.time()

    ids_np = np.load(args.ids).astype(np.int64)
    if ids_np.ndim == 1:
        ids_np = ids_np[None]
    ids = torch.from_numpy(ids_np)
    b, s = ids.shape
    assert 1 <= args.prefill <= s
    res = {"ids": ids_np.astype(np.int32)}

    full = logits_of(model, ids, use_cache=False)
    t["full_forward"] = time.time()

    ties = count_indexer_ties(model)
    causal, g_tok, g_log = cached_decode(model, ids, args.prefill, args.greedy)
    t["cached_decode"] = time.time()
    print(f"indexer top-k boundary ties during cached decode, per CSA layer: {ties}")

    if args.positions == "all":
        pos = list(range(s))
    elif args.positions == "none":
        pos = []
    else:
        pos = sorted({int(x) for x in args.positions.split(",")})
    need = sorted(set(pos) | set(range(args.prefill - 1)))  # prefill positions < prefill-1 come from here
    pref = {p: logits_of(model, ids[:, : p + 1], use_cache=False)[:, -1] for p in need}
    t["prefix_forwards"] = time.time()

    logits_causal = torch.cat([torch.zeros(b, args.prefill - 1, causal.shape[-1]), causal], 1)
    for p in range(args.prefill - 1):
        logits_causal[:, p] = pref[p]
    worst = 0.0
    for p in pos:
        if p >= args.prefill - 1:
            d = (logits_causal[:, p] - pref[p]).abs().max().item()
            worst = max(worst, d)
    print(f"cache vs prefix: max |diff| = {worst:.3g} over {len(pos)} positions (atol {args.atol})")

    diff = (full - logits_causal).abs().amax(-1)  # [b, s]
    for r in range(b):
        bad = [p for p in range(s) if diff[r, p] > args.atol]
        print(f"row {r}: full forward != causal at {len(bad)} positions {bad[:40]}"
              f"{' ...' if len(bad) > 40 else ''} (max {diff[r].max().item():.3g})")

    res.update(indexer_boundary_ties=np.array(ties, np.int32), topk_mode=np.array(args.topk),
               logits_causal=logits_causal.numpy(), logits_full_forward=full.numpy(),
               full_minus_causal_maxabs=diff.numpy(), positions=np.array(pos, np.int32),
               logits_prefix=(torch.stack([pref[p] for p in pos], 1).numpy() if pos
                              else np.zeros((b, 0, full.shape[-1]), np.float32)))
    if args.greedy:
        res["greedy_tokens"] = torch.stack(g_tok, 1).numpy().astype(np.int32)
        res["greedy_logits"] = torch.stack(g_log, 1).numpy()
        print("greedy:", res["greedy_tokens"].tolist())
    np.savez(args.out, **res)
    keys = list(t)
    print("timings: " + ", ".join(f"{k} {t[k] - t[keys[i - 1]]:.2f}s" for i, k in enumerate(keys) if i)
          + f", total {time.time() - t['start']:.2f}s")
    if worst > args.atol:
        msg = f"cached decode and prefix forward disagree: {worst:.3g} > {args.atol}"
        if args.topk == "stable":
            sys.exit(msg)
        print(f"WARNING ({args.topk} top-k, expected after indexer ties): {msg}")


if __name__ == "__main__":
    main()
