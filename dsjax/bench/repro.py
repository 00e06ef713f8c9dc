"""`dsjax bench repro`: the rival's Tetris run, reproduced the way SGLang's V4.1 journey reports it.

One streamed greedy request of the prompt below through the chat encoding (thinking off), a warm-up run dropped,
then the median and range of `--runs` runs. tokens/s = tokens after the first / seconds from the first to the last
token (prefill excluded); TTFT = request start to the first token; TPOT = the inverse of tokens/s.

On a layer slice (`--model slice:v4-flash[:LAYERS[:EXPERTS]]`, random weights) acceptance is forced
("simulated", default 5.6 like the rival's), EOS is ignored, and the full model's step time is extrapolated from
the slice at two depths (labelled); on a trained checkpoint acceptance is real.
"""

from __future__ import annotations

import hashlib
import statistics
import sys

from dsjax.config import KERNELS_HELP, kernels_arg

PROMPT = "implement the tetris game. output HTML code directly - no explanation."
RIVAL = {"engine": "rival Rust+CUDA engine (V4.1-Flash, 8xB300)", "ms_per_step": 2.71, "tokens_per_s": 2060,
         "acceptance_length": 5.6}


def add_args(p) -> None:
    p.add_argument("--model", default="slice:v4-flash",
                   help="slice:v4-flash[:LAYERS[:EXPERTS]] (random weights, simulated acceptance; default, needs a "
                        "GPU), or a checkpoint directory / preset for real acceptance")
    p.add_argument("--runs", type=int, default=6, help="timed runs after the warm-up (default 6)")
    p.add_argument("--max-new-tokens", type=int, default=5142, help="tokens per run (default 5142, the rival's)")
    p.add_argument("--speculative", choices=["auto", "mtp", "dspark", "none"], default="auto",
                   help="draft with the model's own drafter (auto: MTP for V4, DSpark for V4.1), or none")
    p.add_argument("--draft-tokens", type=int, default=5, help="drafts per step (default 5: verify blocks of 6)")
    p.add_argument("--simulated-acceptance", type=float, default=None,
                   help="force this mean acceptance length (bonus included). Default: 5.6 on a slice, real "
                        "acceptance otherwise")
    p.add_argument("--ignore-eos", action=__import__("argparse").BooleanOptionalAction, default=None,
                   help="generate all --max-new-tokens (default: on for slices)")
    p.add_argument("--steps-per-dispatch", type=int, default=32, help="loop steps per device dispatch (default 32)")
    p.add_argument("--kernels", default="auto", type=kernels_arg, help=KERNELS_HELP)
    p.add_argument("--extrapolate-from", type=int, default=4,
                   help="slices only: also time the slice's first N layers; the per-layer difference extrapolates "
                        "the full model's step (default 4; 0 = skip; V4.1 slices always use 3, their encoder "
                        "layers and all, for a per-kind fit)")
    p.add_argument("--out", default=None, help="write the JSON report here")


def _load(args):
    from dsjax.bench.slices import slice_model

    if args.model.startswith("slice:"):
        max_seq = -(-(args.max_new_tokens + 256 + args.draft_tokens) // 256) * 256
        return slice_model(args.model, kernels=args.kernels, max_seq_len=max_seq, max_batch=1), True
    import dsjax

    from dsjax.errors import ConfigError, ContextLimitError

    max_seq = min(-(-(args.max_new_tokens + 256) // 256) * 256, 1 << 20)
    try:
        return dsjax.load(args.model, kernels=args.kernels, max_seq_len=max_seq, max_batch=1), False
    except ContextLimitError as e:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens} needs {max_seq} positions (prompt and drafts "
                          f"included), more than {args.model} holds ({e.limit}); pass a smaller --max-new-tokens"
                          ) from e


def _run_once(model, ids, opts, meter):
    import jax

    from dsjax.generate import stream

    n = 0
    with model._on_mesh():
        gen = stream(model.params, model.cfg, [ids], opts, max_seq=model.max_seq_len, max_batch=1)
        for new, _done, stats in gen:
            n += len(new[0])
            meter.update(len(new[0]))
    carry = stats["carry"]
    out = {"tokens": n, "steps": stats["steps"], "decode_s": stats["decode_s"], "prefill_ttft_s": stats["ttft_s"]}
    if hasattr(carry, "accepted_at"):
        drafted, accepted, at = jax.device_get((carry.drafted, carry.accepted, carry.accepted_at))
        out.update(drafted=int(drafted[0]), accepted=int(accepted[0]), accepted_at=[int(x) for x in at[0]])
    return out


def _summary(values) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run(args, model=None) -> int:
    """`model`: an already loaded one (tests), instead of loading `args.model`."""
    import numpy as np

    from dsjax.bench.report import write_report
    from dsjax.chat import encode_messages_to_ids
    from dsjax.cli_generate import Speedometer
    from dsjax.generate import GenerateOptions
    from dsjax.tokenizer import load_tokenizer

    model, is_slice = _load(args) if model is None else (model, model.cfg.name.find("-slice") > 0)
    cfg = model.cfg
    family = "v4.1" if cfg.family == "v4.1" else "v4"
    ids = encode_messages_to_ids([{"role": "user", "content": PROMPT}], family=family, thinking=False,
                                 tokenizer=load_tokenizer(family))
    kind = args.speculative if args.speculative != "auto" else ("dspark" if cfg.family == "v4.1" else "mtp")
    spec = kind != "none"
    sim = args.simulated_acceptance if args.simulated_acceptance is not None else (5.6 if is_slice else None)
    ignore_eos = is_slice if args.ignore_eos is None else args.ignore_eos
    from dsjax.bench.step_loop import simulated_pattern

    kw = dict(max_new_tokens=args.max_new_tokens, stop_token_ids=() if ignore_eos else (cfg.eos_token_id,),
              steps_per_dispatch=args.steps_per_dispatch, prefill_chunk=256)
    if spec:
        kw.update(speculative=kind, num_draft_tokens=args.draft_tokens)
        if sim is not None:
            kw["forced_acceptance"] = simulated_pattern(sim, args.draft_tokens)
    opts = GenerateOptions(**kw)
    print(f"model: {model.source}\nprompt: {len(ids)} tokens; {args.runs} runs + 1 warm-up; "
          f"{kind.upper() + ' k=' + str(args.draft_tokens) if spec else 'no speculation'}"
          f"{f', simulated acceptance {sim}' if spec and sim is not None else ''}", file=sys.stderr)
    runs = []
    for i in range(args.runs + 1):
        meter = Speedometer()
        rec = _run_once(model, ids, opts, meter)
        rec.update(meter.close())
        rec["warmup"] = i == 0
        runs.append(rec)
    timed = [r for r in runs if not r["warmup"]]
    tps = [r["tokens_per_s"] for r in timed]
    step_ms = [1e3 * r["decode_s"] / max(r["steps"], 1) for r in timed]
    report = {
        "model": model.source, "config": cfg.name, "kernels": cfg.kernels, "prompt": PROMPT,
        "prompt_ids": ids, "prompt_sha256": hashlib.sha256(np.asarray(ids, np.int64).tobytes()).hexdigest(),
        "chat": {"thinking": False, "family": family}, "temperature": 0.0, "ignore_eos": ignore_eos,
        "output_tokens": [r["tokens"] for r in timed],
        "tokens_per_s": _summary(tps),
        "tokens_per_s_definition": "(output tokens - 1) / seconds from the first to the last streamed token",
        "ttft_s": _summary([r["ttft_s"] for r in timed]),
        "tpot_ms": _summary([1e3 / t for t in tps if t]),
        "steps": [r["steps"] for r in timed], "ms_per_step": _summary(step_ms),
        "runs": runs, "rival": RIVAL,
    }
    if spec:
        report["acceptance"] = _acceptance(timed, args.draft_tokens, simulated=sim is not None)
    if is_slice and args.extrapolate_from:
        report["full_model"] = extrapolate(model, args, sim if spec else None)
    write_report("repro", None, args.out, **report)
    med = report["tokens_per_s"]["median"]
    print(f"{int(statistics.median(report['output_tokens'])):,} tokens at {med:,.0f} tokens/s, first token after "
          f"{report['ttft_s']['median']:.2f} seconds (median of {len(timed)})", file=sys.stderr)
    return 0


def step_acceptance_lengths(accepted_at, steps: int) -> "np.ndarray":
    """Per-step acceptance lengths (bonus included) recovered from per-position counts: drafts are accepted as a
    prefix, so accepted_at[j] counts the steps that accepted at least j + 1 drafts."""
    import numpy as np

    at = [steps, *(int(x) for x in accepted_at), 0]
    counts = [at[j] - at[j + 1] for j in range(len(at) - 1)]  # steps that accepted exactly j drafts
    if min(counts) < 0:
        raise ValueError(f"accepted_at {list(accepted_at)} is not a prefix count over {steps} steps")
    return np.repeat(np.arange(1, len(counts) + 1), counts)


def _acceptance(timed, k: int, *, simulated: bool) -> dict:
    """Acceptance length = committed tokens per verify step (bonus included): the mean per run, p50 / p90 over
    every timed step, and the acceptance rate per draft position."""
    import numpy as np

    per_run = [(r["tokens"] - 1) / r["steps"] for r in timed if r.get("steps")]
    at = np.sum([r["accepted_at"] for r in timed], axis=0) / max(sum(r["steps"] for r in timed), 1)
    steps = np.concatenate([step_acceptance_lengths(r["accepted_at"], r["steps"]) for r in timed if r.get("steps")])
    return {"label": "simulated (forced acceptance: speed, not model quality)" if simulated else "real",
            "mean": float(np.mean(per_run)), "p50": float(np.percentile(steps, 50)),
            "p90": float(np.percentile(steps, 90)), "percentiles_over": f"{steps.size} verify steps",
            "per_position": [float(x) for x in at], "k": k}


def extrapolate(model, args, acceptance: float | None) -> dict:
    """Full-depth step time from the slice at two depths (V4.1: three; same weights: the shallower ones are
    prefixes), at the run's mean context; tokens/s = tokens per step / extrapolated step. Labelled: an
    extrapolation."""
    from dsjax.bench.slices import full_config, full_depth, proxy_depths, shallower
    from dsjax.bench.step_loop import time_loop

    cfg = model.cfg
    k = args.draft_tokens if args.speculative != "none" else 0
    ctx = 256 + args.max_new_tokens // 2
    depths = proxy_depths(cfg, args.extrapolate_from)
    t = {L: time_loop(model if L == cfg.n_layers else shallower(model, L), batch=1, ctx=ctx, k=k,
                      acceptance_length=acceptance, steps=128, steps_per_dispatch=args.steps_per_dispatch)["ms_per_step"]
         for L in depths}
    fit = full_depth(cfg, t)
    tokens_per_step = min(acceptance, k + 1) if (k and acceptance) else 1.0   # forcing caps at k drafts + bonus
    return {"label": "extrapolated from a layer slice (random weights)", "context": ctx,
            "slice_ms_per_step": t, "per_layer_ms": fit["per_layer"], "layers": full_config(cfg).n_layers,
            "ms_per_step": fit["full"], "tokens_per_step": tokens_per_step,
            "tokens_per_s": 1e3 * tokens_per_step / fit["full"], "method": fit["method"]}


if __name__ == "__main__":
    from dsjax.bench.report import script_main

    raise SystemExit(script_main(__spec__.name))
