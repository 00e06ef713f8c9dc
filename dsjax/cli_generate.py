"""`dsjax generate` and `dsjax chat`: streamed text with a live tokens/s readout."""

from __future__ import annotations

import json
import sys
import time

from dsjax.errors import InputError


class Speedometer:
    """A one-line tokens/s readout on stderr (only when it is a terminal), and the closing summary."""

    def __init__(self, stream=None):
        stream = sys.stderr if stream is None else stream  # looked up per call: a default bound at import time
        self.stream, self.live = stream, stream.isatty()  # outlives a test's captured (then closed) stderr
        self.t0 = time.perf_counter()
        self.first = None
        self.n = 0

    def update(self, n_new: int) -> None:
        if n_new and self.first is None:
            self.first = time.perf_counter()
            self.first_unix = time.time()
        self.n += n_new
        if self.live and self.first is not None:
            dt = max(time.perf_counter() - self.first, 1e-9)
            self.stream.write(f"\r\x1b[2K[{self.n} tokens, {self.n / dt:,.1f} tokens/s]")
            self.stream.flush()

    def summary(self) -> dict:
        end = time.perf_counter()
        ttft = (self.first or end) - self.t0
        rate = (self.n - 1) / (end - self.first) if self.first and self.n > 1 and end > self.first else 0.0
        return {"tokens": self.n, "tokens_per_s": rate, "ttft_s": ttft, "total_s": end - self.t0,
                "first_token_unix_s": getattr(self, "first_unix", None)}

    def close(self) -> dict:
        s = self.summary()
        if self.live:
            self.stream.write("\r\x1b[2K")
        self.stream.write(f"{s['tokens']:,} tokens at {s['tokens_per_s']:,.1f} tokens/s, first token after "
                          f"{s['ttft_s']:.2f} seconds\n")
        self.stream.flush()
        return s


def _sampling_kwargs(args) -> dict:
    kw = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed)
    if args.speculative:
        kw.update(speculative=args.speculative, num_draft_tokens=args.draft_tokens)
    if getattr(args, "prefill_schedule", "exact") != "exact":
        kw.update(prefill_schedule=args.prefill_schedule)
    return kw


def _prompt_ids(args, tok, family: str, thinking: bool, history=None, image_token_id: int = 129264) -> list[int]:
    """The prompt's token ids; with `--image`, one image placeholder per image before the text (in the user turn
    with --chat), which generation expands into the image's span."""
    from dsjax.chat import encode_messages_to_ids

    images = list(getattr(args, "image", None) or [])
    if args.chat or history is not None:
        messages = list(history or [])
        if history is None:
            if args.system:
                messages.append({"role": "system", "content": args.system})
            content = args.prompt
            if images:
                content = [{"type": "image_url", "image_url": {"url": path}} for path in images]
                content.append({"type": "text", "text": args.prompt})
            messages.append({"role": "user", "content": content})
        return encode_messages_to_ids(messages, family=family, thinking=thinking, tokenizer=tok)
    return [0] + [image_token_id] * len(images) + tok.encode(args.prompt)  # raw completion: BOS, images, text


def run_stream(model, tok, ids, args, out=None, images=None):
    """Generate from `ids`, printing text as it arrives; returns (token ids, stats)."""
    out = sys.stdout if out is None else out
    dec = tok.incremental_decoder(skip_special_tokens=not args.show_special)
    meter = Speedometer()
    tokens = []
    for new in model.stream([ids], args.max_new_tokens, images=images, **_sampling_kwargs(args)):
        tokens.extend(new[0])
        meter.update(len(new[0]))
        if not args.json:
            out.write(dec.add(new[0]))
            out.flush()
    if not args.json:
        out.write(dec.flush() + "\n")
    stats = meter.close() if not args.json else meter.summary()
    return tokens, stats


def cmd_generate(args) -> int:
    import dsjax
    from dsjax.tokenizer import load_tokenizer

    if not args.prompt:
        raise InputError("--prompt is empty")
    model = dsjax.load(args.model, numerics=args.numerics, seed=args.weights_seed, max_seq_len=args.max_seq_len,
                       compilation_cache=args.compilation_cache)
    family = "v4.1" if model.cfg.family == "v4.1" else "v4"
    if args.image and not model.cfg.vision_enabled:
        raise InputError(f"--image: {model.cfg.name} has no vision tower (V4.1 models with vision_n_layers > 0 do)")
    images = None
    if args.image:
        from dsjax.vision import load_rgb

        images = [[load_rgb(path, name=path) for path in args.image]]  # bad files fail here, before any compile
    tok = load_tokenizer(family)
    if "random weights" in model.source and not args.json:
        print(f"[{model.source}: the text below is noise, not language]", file=sys.stderr)
    ids = _prompt_ids(args, tok, family, args.thinking, image_token_id=model.cfg.image_token_id)
    tokens, stats = run_stream(model, tok, ids, args, images=images)
    if args.json:
        print(json.dumps({"model": model.source, "prompt_ids": ids, "token_ids": tokens,
                          "text": tok.decode(tokens, skip_special_tokens=not args.show_special), "stats": stats}))
    return 0


def cmd_chat(args) -> int:
    import dsjax
    from dsjax.chat import parse_output
    from dsjax.tokenizer import load_tokenizer

    model = dsjax.load(args.model, numerics=args.numerics, seed=args.weights_seed, max_seq_len=args.max_seq_len,
                       compilation_cache=args.compilation_cache)
    family = "v4.1" if model.cfg.family == "v4.1" else "v4"
    tok = load_tokenizer(family)
    thinking = args.thinking
    history = [{"role": "system", "content": args.system}] if args.system else []
    print(f"dsjax chat — {model.source}. /think and /nothink toggle thinking (now "
          f"{'on' if thinking else 'off'}), /reset clears the conversation, /exit or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        cmd = line.strip()
        if cmd in ("/exit", "/quit"):
            return 0
        if cmd in ("/think", "/nothink"):
            thinking = cmd == "/think"
            print(f"[thinking {'on' if thinking else 'off'}]", file=sys.stderr)
            continue
        if cmd == "/reset":
            history = history[:1] if args.system else []
            continue
        if not cmd:
            continue
        history.append({"role": "user", "content": line})
        ids = _prompt_ids(args, tok, family, thinking, history=history)
        sys.stdout.write("assistant> ")
        tokens, _ = run_stream(model, tok, ids, args)
        parsed = parse_output(tok.decode(tokens), family=family, thinking=thinking)
        history.append({"role": "assistant", "content": parsed.content, "reasoning_content": parsed.reasoning})


def add_generation_args(p) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64, help="most tokens to generate (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); the model card suggests 1.0")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability (default 0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--thinking", action=__import__("argparse").BooleanOptionalAction, default=False,
                   help="chat prompts end in <think> (reason first) instead of </think> (answer directly; default)")
    p.add_argument("--speculative", choices=["mtp", "dspark"], default=None,
                   help="draft with the model's MTP head (V4) or its DSpark stages (V4.1) and verify k+1 positions "
                        "per step (greedy output unchanged)")
    p.add_argument("--draft-tokens", type=int, default=None,
                   help="drafts per step with --speculative (default 2 for mtp, the DSpark block size for dspark)")
    p.add_argument("--prefill-schedule", choices=["exact", "replay"], default="exact",
                   help="V4.1: 'replay' runs the decoder layers only for the prompt's last window (CED prefill with "
                        "SWA bounded replay, the production schedule: faster on long prompts, logits approximate)")
    p.add_argument("--system", default=None, help="system prompt for --chat / chat")
    p.add_argument("--max-seq-len", type=int, default=None, help="cache length per sequence (default min(4096, model))")
    p.add_argument("--show-special", action="store_true", help="print special tokens such as </think> in the text")
    p.add_argument("--weights-seed", type=int, default=0, help="seed of a preset's random weights (default 0)")
    from dsjax.api import DEFAULT_COMPILATION_CACHE

    p.add_argument("--compilation-cache", default=DEFAULT_COMPILATION_CACHE,
                   help=f"JAX persistent compilation cache directory (default {DEFAULT_COMPILATION_CACHE})")
