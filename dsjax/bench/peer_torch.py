"""The peer side of `dsjax bench peer`: transformers' DeepseekV4ForCausalLM, eager, bf16, on the GPU.

Run by `dsjax.bench.peer` as a subprocess (so torch and JAX never share the GPU's memory at once); never imports
jax. Builds the model from a transformers config with random weights on the GPU, times a prefill of the prompt
and greedy decode steps with the model's own cache (batch 1; transformers has no static cache or compile path
for V4), saves the weights with `save_pretrained` so dsjax loads the very same tensors, and writes the last prompt
position's logits for a sanity comparison.

    python -m dsjax.bench.peer_torch --config hf_config.json --out-dir DIR [--prompt-len 1024] [--decode 32]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

# run as a script, this folder would come first on sys.path and its kernels.py would shadow the `kernels`
# package transformers imports
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]


def _layout():
    """dsjax/transformers_layout.py by path: importing the dsjax package would import jax."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "transformers_layout.py")
    spec = importlib.util.spec_from_file_location("transformers_layout", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="HF or official-style config.json")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--decode", type=int, default=32, help="greedy decode steps timed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda", help="torch device (cpu only for smoke runs)")
    args = ap.parse_args(argv)

    import numpy as np
    import torch
    import transformers
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    hf = _layout().hf_config_from_official(json.load(open(args.config)), dtype="bfloat16")
    cfg = DeepseekV4Config(**hf)
    cfg._attn_implementation = "eager"
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    with torch.device(args.device):
        model = DeepseekV4ForCausalLM(cfg).to(torch.bfloat16).eval()
    init_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, cfg.vocab_size, (1, args.prompt_len), generator=g).to(args.device)

    def sync():
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    with torch.no_grad():
        out = model(input_ids=ids[:, :64], use_cache=True)  # warm-up (allocator, kernels)
        sync()
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True)
        sync()
        prefill_s = time.perf_counter() - t0
        last_logits = out.logits[0, -1].float().cpu().numpy()
        cache = out.past_key_values
        tok = out.logits[:, -1:].argmax(-1)
        times, toks = [], []
        for _ in range(args.decode):
            t0 = time.perf_counter()
            out = model(input_ids=tok, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            sync()
            times.append(time.perf_counter() - t0)
            cache = out.past_key_values
            toks.append(int(tok[0, 0]))
    ckpt = os.path.join(args.out_dir, "checkpoint")
    model.save_pretrained(ckpt)
    np.save(os.path.join(args.out_dir, "peer_last_logits.npy"), last_logits)
    np.save(os.path.join(args.out_dir, "prompt_ids.npy"), ids.cpu().numpy().astype(np.int32))
    steady = sorted(times[2:] or times)
    rep = {"engine": f"transformers {transformers.__version__} DeepseekV4ForCausalLM (eager, bf16, torch "
                     f"{torch.__version__})", "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device, "init_s": init_s,
           "prompt_len": args.prompt_len, "prefill_s": prefill_s, "prefill_tokens_per_s": args.prompt_len / prefill_s,
           "decode_steps": args.decode, "decode_ms_per_step_median": 1e3 * steady[len(steady) // 2],
           "decode_ms_per_step_min": 1e3 * steady[0], "greedy_tokens": toks, "checkpoint": ckpt}
    with open(os.path.join(args.out_dir, "peer.json"), "w") as f:
        json.dump(rep, f, indent=1)
    print(json.dumps(rep), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
