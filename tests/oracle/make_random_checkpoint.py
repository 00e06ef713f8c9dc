#!/usr/bin/env python
"""Build a random-weight transformers ``DeepseekV4ForCausalLM`` and ``save_pretrained`` it.

Run with the oracle venv (``tests/oracle/build_venv.sh``)::

    .oracle-venv/bin/python tests/oracle/make_random_checkpoint.py \
        --config cfg.json --out /tmp/v4_rand [--seed 0] [--init dsjax|hf] [--dtype float32]

Why: it is the ground truth for what transformers 5.24 *actually* writes (tensor names, shapes, dtypes,
whether MTP weights or FP8 scales appear) and so the check for ``dsjax/transformers_layout.py``; and it
gives the oracle small random models to run (``run_transformers.py``) without any official checkpoint.

``--config`` may be an HF config.json (``layer_types`` / ``compress_rates``) or an official-style one
(``compress_ratios`` list, ``rope_scaling``, ``num_hash_layers`` ...); it goes through
``hf_config_from_official`` either way. ``--init hf`` keeps transformers' own ``_init_weights`` (sinks,
position_bias, gate bias and tid2eid all ZERO: a weak test); ``--init dsjax`` (default) draws every tensor
like the shared goldens do (wide gate, non-zero sinks/ape/bias, distinct hash experts per token, a shared
expert wide enough to hit the SwiGLU clamp) so every code path matters.
"""
import argparse
import importlib.util
import json
import os
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_layout():
    """Import dsjax/transformers_layout.py by path: the dsjax package itself may import jax."""
    path = os.path.join(REPO, "dsjax", "transformers_layout.py")
    spec = importlib.util.spec_from_file_location("transformers_layout", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# Built-in tiny config (``--config tiny``): hidden 64, 6 layers = 2 SWA + 2 CSA (ratio 4, indexer top-6) +
# 2 HCA (ratio 8), window 16, 8 experts top-2, 2 hash layers, YaRN as released. Official-style keys on purpose
# (compress_ratios / num_hash_layers / rope_scaling) so it also exercises hf_config_from_official.
TINY_CONFIG = {
    "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4, "head_dim": 32,
    "qk_rope_head_dim": 16, "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16, "sliding_window": 16,
    "compress_ratios": [0, 0, 4, 8, 4, 8, 0], "compress_rope_theta": 160000, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "index_n_heads": 4, "index_head_dim": 32, "index_topk": 6, "n_routed_experts": 8, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "num_hash_layers": 2, "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "norm_topk_prob": True, "rms_norm_eps": 1e-6,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "max_position_embeddings": 4096,
    "num_nextn_predict_layers": 1, "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
}


def dsjax_init_(model, cfg, seed):
    """Goldens-style random init (see /work/shared/goldens/README.md §4), keyed on the internal names."""
    g = torch.Generator().manual_seed(seed)
    D, inter, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts

    def normal(shape, var):
        return torch.randn(shape, generator=g) * var**0.5

    def uniform(shape, lo, hi):
        return lo + (hi - lo) * torch.rand(shape, generator=g)

    sd = model.state_dict()
    for name, t in sorted(sd.items()):
        shp = tuple(t.shape)
        if name.endswith("tid2eid"):
            new = torch.stack([torch.randperm(E, generator=g)[: shp[1]] for _ in range(shp[0])])
        elif name.endswith("e_score_correction_bias"):
            new = normal(shp, 0.25)
        elif name.endswith("sinks"):
            new = normal(shp, 1.0)
        elif name.endswith("position_bias"):
            new = normal(shp, 0.25)
        elif "norm" in name.split(".")[-2] or name == "model.norm.weight":
            new = uniform(shp, 0.8, 1.2)
        elif name.endswith((".fn", "hc_fn")):
            new = normal(shp, 1.0 / (cfg.hc_mult * D))
        elif name.endswith((".base", "hc_base")):
            new = normal(shp, 0.25)
        elif name.endswith((".scale", "hc_scale")):
            new = uniform(shp, 0.5, 1.5)
        elif name == "model.embed_tokens.weight":
            new = normal(shp, 1.0)
        elif name == "lm_head.weight":
            new = normal(shp, 4.0 / D)
        elif name.endswith("mlp.gate.weight"):
            new = normal(shp, 16.0 / D)
        elif name.endswith("experts.gate_up_proj"):
            new = normal(shp, 2.25 / D)
        elif name.endswith("experts.down_proj") or name.endswith("shared_experts.down_proj.weight"):
            new = normal(shp, 0.01 / inter)
        elif "shared_experts" in name:
            new = normal(shp, 16.0 / D)
        elif t.ndim == 2:
            new = normal(shp, 1.0 / shp[1])
        else:
            raise KeyError(f"no init rule for {name} {shp}")
        t.copy_(new.to(t.dtype))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="config.json path, or 'tiny' for the built-in one")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init", choices=["dsjax", "hf"], default="dsjax")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--keep-quant-config", action="store_true",
                    help="leave quantization_config in the config (to see what save/load do with it)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    lay = load_layout()
    raw = TINY_CONFIG if args.config == "tiny" else json.load(open(args.config))
    hf = lay.hf_config_from_official(raw, keep_quantization_config=args.keep_quant_config)
    cfg = DeepseekV4Config(**hf)
    torch.manual_seed(args.seed)
    model = DeepseekV4ForCausalLM(cfg).eval()
    if args.init == "dsjax":
        with torch.no_grad():
            dsjax_init_(model, cfg, args.seed)
    model = model.to(getattr(torch, args.dtype))
    model.save_pretrained(args.out)
    print(f"saved {args.out} in {time.time() - t0:.1f}s")

    from safetensors import safe_open
    files = sorted(f for f in os.listdir(args.out) if f.endswith(".safetensors"))
    print("files:", os.listdir(args.out))
    for f in files:
        with safe_open(os.path.join(args.out, f), "pt") as st:
            keys = list(st.keys())
            print(f"{f}: {len(keys)} tensors")
            for k in keys:
                sl = st.get_slice(k)
                print(f"  {k} {sl.get_shape()} {sl.get_dtype()}")
    saved_cfg = json.load(open(os.path.join(args.out, "config.json")))
    print("saved quantization_config:", saved_cfg.get("quantization_config"))
    check_layout(lay, model, os.path.join(args.out, "model.safetensors"))


def check_layout(lay, model, path):
    """Assert dsjax/transformers_layout.py predicts exactly what save_pretrained wrote and what
    model.state_dict() holds (names, shapes, values), in both directions."""
    import numpy as np
    from safetensors.numpy import load_file

    saved = load_file(path)
    official = {}
    for n, a in saved.items():
        for k, v in lay.transformers_to_official(n, a, "saved"):
            official[k] = v
    internal = {k: v.detach().float().numpy() if v.is_floating_point() else v.numpy()
                for k, v in model.state_dict().items()}
    for layout, want in (("saved", saved), ("internal", internal)):
        got = lay.official_state_to_transformers(official, layout)
        assert set(got) == set(want), (layout, sorted(set(got) ^ set(want))[:10])
        bad = [k for k in want if got[k].shape != want[k].shape or not np.array_equal(got[k], want[k])]
        assert not bad, (layout, bad[:10])
        back = {}
        for n, a in got.items():
            for k, v in lay.transformers_to_official(n, a, layout):
                back[k] = v
        assert set(back) == set(official) and all(np.array_equal(back[k], official[k]) for k in back), layout
    print(f"layout check OK: {len(official)} official tensors <-> {len(saved)} saved / {len(internal)} internal")


if __name__ == "__main__":
    sys.exit(main())
