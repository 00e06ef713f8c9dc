"""`dsjax` command line: generate, chat, logits, convert, info, plan, bench, serve. `dsjax COMMAND --help` explains each flag."""

from __future__ import annotations

import argparse
import json
import sys
import time

DEFAULT_MODEL = "dsjax-small"


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="checkpoint directory (official or transformers layout, or a dsjax Orbax directory) or a "
                        f"bundled checkpoint, or a preset name (random weights) (default: {DEFAULT_MODEL}, a 12.7M-parameter "
                        "V4-architecture model trained on Python source, bundled)")
    p.add_argument("--numerics", default="reference-bf16", choices=["transformers", "reference-bf16", "reference-fp8"],
                   help="numeric preset: what transformers computes (fp32, no fake quant), DeepSeek's reference with "
                        "bf16 weights (KV FP8 + index FP4 rounding), or the reference with FP8 activations too")


def cmd_logits(args) -> int:
    import numpy as np

    import dsjax
    from dsjax.tokenizer import load_tokenizer

    t0 = time.perf_counter()
    model = dsjax.load(args.model, numerics=args.numerics, seed=args.weights_seed)
    tok = load_tokenizer("v4.1" if model.cfg.family == "v4.1" else "v4")
    ids = tok.encode(args.prompt)
    if not ids:
        print("error: the prompt encodes to no tokens", file=sys.stderr)
        return 2
    if len(ids) > model.cfg.max_position_embeddings:
        print(f"error: prompt has {len(ids)} tokens, more than the model's {model.cfg.max_position_embeddings}",
              file=sys.stderr)
        return 2
    t1 = time.perf_counter()
    logits = np.asarray(model.logits([ids], positions=[len(ids) - 1]))[0, 0]
    t2 = time.perf_counter()
    top = np.argsort(-logits)[: args.top]
    logp = logits - np.logaddexp.reduce(logits)
    if args.json:
        print(json.dumps({"model": model.source, "prompt_ids": ids,
                          "top": [{"id": int(i), "text": tok.decode([int(i)]), "logprob": float(logp[i])} for i in top],
                          "load_s": t1 - t0, "forward_s": t2 - t1}))
        return 0
    print(f"model: {model.source} ({model.cfg.name}, numerics {model.cfg.numerics})")
    if "random weights" in model.source:
        print("note: random weights — the scores below are noise, not language (the default dsjax-small is trained)")
    print(f"prompt: {len(ids)} tokens; forward (incl. compile) {t2 - t1:.2f} s")
    for i in top:
        print(f"  {int(i):>7d}  {logp[i]:8.3f}  {tok.decode([int(i)])!r}")
    return 0


def cmd_convert(args) -> int:
    import dsjax
    from dsjax import orbax_io

    model = dsjax.load(args.src)
    orbax_io.save(args.dst, model.params, model.cfg)
    print(f"wrote {args.dst} ({model.cfg.name})")
    return 0


def cmd_info(args) -> int:
    from dsjax.api import model_config
    from dsjax.weights import nbytes

    cfg = model_config(args.model)
    out = cfg.to_dict()
    try:
        out["weight_bytes"] = nbytes(cfg)
    except NotImplementedError as e:  # V4.1: the config is known, its weight tree is not written yet
        out["weight_bytes"], out["weight_bytes_note"] = None, str(e)
    out["layer_kinds"] = [cfg.layer_kind(i) for i in range(cfg.n_layers)]
    print(json.dumps(out, indent=1))
    return 0


def cmd_serve(args) -> int:
    from dsjax.serving.config import from_args
    from dsjax.serving.server import serve

    return serve(from_args(args))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsjax", description="DeepSeek-V4-family inference in JAX.")
    sub = p.add_subparsers(dest="command", required=True)
    lg = sub.add_parser("logits", help="print the most likely next tokens after a prompt",
                        description="Print the most likely next tokens after a prompt.")
    _add_model_args(lg)
    lg.add_argument("--prompt", required=True, help="text to score (encoded with the real DeepSeek-V4 tokenizer)")
    lg.add_argument("--top", type=int, default=10, help="how many candidates to print (default 10)")
    lg.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    lg.add_argument("--weights-seed", type=int, default=0, help="seed of a preset's random weights (default 0)")
    lg.set_defaults(func=cmd_logits)
    from dsjax.cli_generate import add_generation_args, cmd_chat, cmd_generate

    gen = sub.add_parser("generate", help="generate text from a prompt, streamed, with a tokens/s readout")
    _add_model_args(gen)
    gen.add_argument("--prompt", required=True, help="the prompt text (raw completion, or a user turn with --chat)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat format")
    gen.add_argument("--json", action="store_true", help="print one JSON object: prompt ids, token ids, text, stats")
    gen.add_argument("--image", action="append", default=[], metavar="PATH",
                     help="an image file (PNG, JPEG, WebP, GIF, BMP) placed before the prompt text; repeatable "
                          "(V4.1 models with a vision tower)")
    add_generation_args(gen)
    gen.set_defaults(func=cmd_generate)
    ch = sub.add_parser("chat", help="interactive multi-turn chat (thinking toggle with /think, /nothink)")
    _add_model_args(ch)
    add_generation_args(ch)
    ch.set_defaults(func=cmd_chat, chat=True, json=False, prompt=None, image=[])
    cv = sub.add_parser("convert", help="convert a checkpoint directory into a dsjax Orbax directory",
                        description="Convert a checkpoint directory into a dsjax Orbax directory (faster to load).")
    cv.add_argument("src", help="checkpoint directory (official or transformers layout)")
    cv.add_argument("dst", help="new, empty output directory")
    cv.set_defaults(func=cmd_convert)
    inf = sub.add_parser("info", help="print a model's config and its weight bytes (no weights read)",
                         description="Print the config of anything --model takes (a checkpoint or Orbax directory, "
                                     "a config.json, the bundled dsjax-small, a preset) as JSON, with its weight "
                                     "bytes and layer kinds; no weights are read.")
    inf.add_argument("model", help="checkpoint / Orbax directory, config.json path, bundled checkpoint (dsjax-small) "
                                   "or preset name")
    inf.set_defaults(func=cmd_info)
    from dsjax.cli_plan import add_plan_parser

    add_plan_parser(sub)
    from dsjax.cli_bench import add_bench_parser

    add_bench_parser(sub)
    from dsjax.cli_train import add_train_parser

    add_train_parser(sub)
    from dsjax.serving.config import add_serve_args

    sv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API and gRPC (continuous batching)",
                        description="Serve HTTP (OpenAI-compatible) and gRPC from one process; see docs/serving.md.")
    add_serve_args(sv)
    sv.set_defaults(func=cmd_serve)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from dsjax.errors import DsjaxError

    try:
        return args.func(args)
    except (DsjaxError, NotImplementedError) as e:  # NotImplementedError: e.g. a V4.1 model, not runnable yet
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
