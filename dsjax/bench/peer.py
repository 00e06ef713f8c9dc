"""`dsjax bench peer`: transformers' DeepseekV4ForCausalLM and dsjax side by side on one GPU, same config, same
weights — the peer run beside ours that every figure is compared with.

1. `peer_torch` (a subprocess: torch alone on the GPU) builds a V4-Flash layer slice in transformers (bf16, eager),
   times a prompt prefill and greedy decode steps with its cache, and saves the weights.
2. dsjax loads those very tensors (transformers layout, bf16) and times the same prefill and decode with the
   `xla` path (our baseline) and `auto` (kernels where measured faster).
3. The last prompt position's logits of the two engines are compared (a sanity check, not the exactness test:
   the CPU tests hold that, in fp32).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile


def add_args(p) -> None:
    p.add_argument("--layers", type=int, default=4, help="slice layers (the model's first ones; default 4)")
    p.add_argument("--experts", type=int, default=32,
                   help="routed experts per layer (default 32: transformers keeps bf16 weights, 50 MB per expert)")
    p.add_argument("--prompt-len", type=int, default=1024, help="prompt tokens (default 1024)")
    p.add_argument("--decode", type=int, default=32, help="decode steps (default 32)")
    p.add_argument("--kernels", default="xla,auto",
                   help="dsjax settings to time, each KERNELS[:NUMERICS] (default xla,auto; numerics default "
                        "reference-bf16; e.g. xla:transformers = fp32 compute, no FP8 rounding: the logit check)")
    p.add_argument("--model", default=None,
                   help="a preset instead of the V4-Flash slice (e.g. tiny-v4, for a CPU smoke run)")
    p.add_argument("--peer-python", default=sys.executable,
                   help="python with torch + transformers (default: this one, as on the GPU image)")
    p.add_argument("--device", default="cuda", help="the peer's torch device (default cuda)")
    p.add_argument("--workdir", default=None, help="where the shared checkpoint goes (default: a temp dir)")
    p.add_argument("--out", default=None, help="write the JSON report here")


def run(args) -> int:
    import numpy as np

    from dsjax.bench.slices import slice_config
    from dsjax.checkpoint import hf_config_dict

    from dsjax.config import preset

    cfg = preset(args.model) if args.model else slice_config(args.layers, args.experts, pattern="model")
    work = args.workdir or tempfile.mkdtemp(prefix="dsjax-peer-")
    os.makedirs(work, exist_ok=True)
    with open(os.path.join(work, "hf_config.json"), "w") as f:
        json.dump(hf_config_dict(cfg, quantized=False), f)
    cmd = [args.peer_python, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer_torch.py"), "--config", os.path.join(work, "hf_config.json"),
           "--out-dir", work, "--prompt-len", str(args.prompt_len), "--decode", str(args.decode), "--device", args.device]
    print("peer:", " ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-6000:], file=sys.stderr)
        return 1
    with open(os.path.join(work, "peer.json")) as f:
        peer = json.load(f)

    import dsjax
    from dsjax.bench.prefill import prefill_seconds
    from dsjax.bench.report import write_report
    from dsjax.bench.step_loop import time_loop

    ids = np.load(os.path.join(work, "prompt_ids.npy"))
    peer_logits = np.load(os.path.join(work, "peer_last_logits.npy"))
    ours = []
    for spec in args.kernels.split(","):
        mode, _, numerics = spec.partition(":")
        model = dsjax.load(peer["checkpoint"], kernels=mode, numerics=numerics or "reference-bf16",
                           max_seq_len=args.prompt_len + 2 * args.decode + 256, max_batch=1)
        pre_s, _ = prefill_seconds(model, args.prompt_len, min(args.prompt_len, 1024))
        dec = time_loop(model, batch=1, ctx=args.prompt_len, k=0, steps=args.decode,
                        steps_per_dispatch=args.decode)
        lg = np.asarray(model.logits(ids, positions=[args.prompt_len - 1]))[0, 0]
        ours.append({"kernels": mode, "numerics": model.cfg.numerics, "prefill_s": pre_s,
                     "prefill_tokens_per_s": args.prompt_len / pre_s, "decode_ms_per_step": dec["ms_per_step"],
                     "speedup_decode_vs_peer": peer["decode_ms_per_step_median"] / dec["ms_per_step"],
                     "speedup_prefill_vs_peer": peer["prefill_s"] / pre_s,
                     "last_logits_max_abs_diff_vs_peer": float(np.abs(lg - peer_logits).max()),
                     "logit_scale": float(np.abs(peer_logits).max()),
                     "argmax_equal": bool(lg.argmax() == peer_logits.argmax())})
        print(json.dumps(ours[-1]), file=sys.stderr, flush=True)
        del model
    write_report("peer", None, args.out, config=cfg.name, weights="bf16 (transformers layout), random",
                 peer=peer, dsjax=ours,
                 note="decode: batch 1, greedy; transformers with its own cache (eager, no compile path), dsjax "
                      "inside its on-device loop (steps per dispatch = all steps). Logit differences: transformers "
                      "computes in bf16 without FP8 rounding; dsjax's reference-bf16 numerics round KV and "
                      "activations to FP8 as DeepSeek's reference does, its transformers numerics compute in fp32.")
    return 0


if __name__ == "__main__":
    from dsjax.bench.report import script_main

    raise SystemExit(script_main(__spec__.name))
