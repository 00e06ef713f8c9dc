"""MTP acceptance length for k = 1..K draft tokens on a trained checkpoint, and speculative vs plain greedy identity.

Prompts are the openings of held-out documents of `dsjax train`'s corpus (Python standard-library files the
bundled model never trained on: BOS + the first --prompt-tokens tokens of each file long enough), all rows
in one batch, greedy, no stop tokens (every row runs --new-tokens). For each k the report gives the mean
acceptance length (tokens per verify step, the bonus token included: what the rival's 5.6 counts), the
per-position acceptance rate, and how many rows produced exactly the plain greedy tokens — and, for a row that
did not, where it first differs and by how much the two greedy candidates' logits were apart there (a near tie
decided differently by a (k+1)-token verify chunk and a 1-token decode step, which round differently in bf16;
`--numerics transformers` computes token by token in fp32, where the two must agree bit for bit).

Random-weight models accept at random: on them the numbers are meaningless (use a trained checkpoint).
"""

from __future__ import annotations

import time

import numpy as np


def add_args(p) -> None:
    p.add_argument("--model", default="dsjax-small", help="checkpoint (default: dsjax-small, the bundled trained model)")
    p.add_argument("--numerics", default="reference-bf16", choices=["transformers", "reference-bf16", "reference-fp8"])
    p.add_argument("--k", default="1,2,3,4", help="draft lengths to measure (default 1,2,3,4)")
    p.add_argument("--prompts", type=int, default=16, help="held-out documents, one row each (default 16)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="prompt length in tokens (default 128)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated per row (default 128)")
    p.add_argument("--out", default=None, help="write the JSON report here")


def held_out_prompts(tok, n: int, length: int, need: int) -> list[list[int]]:
    """BOS + the first `length` tokens of the first `n` held-out corpus documents (sorted by path) with at least
    `need` tokens."""
    from dsjax.train import corpus

    prompts = []
    for doc in corpus.documents():
        if not corpus.is_held_out(doc, 5.0):
            continue
        try:
            with open(doc.path, encoding="utf-8") as f:
                ids = tok.encode(f.read())
        except (OSError, UnicodeDecodeError):
            continue
        if len(ids) >= need:
            prompts.append([tok.special.bos] + ids[:length])
            if len(prompts) == n:
                break
    if not prompts:
        raise SystemExit("no held-out document is long enough; lower --prompt-tokens / --new-tokens")
    return prompts


def first_difference(model, prompt, plain, spec):
    """(index, logit gap between the two candidates under a full forward) of the first differing token."""
    i = next(j for j, (a, b) in enumerate(zip(plain, spec)) if a != b)
    ctx = prompt + plain[:i]
    logits = np.asarray(model.logits([ctx], positions=[len(ctx) - 1]))[0, 0]
    return i, float(abs(logits[plain[i]] - logits[spec[i]]))


def run(args) -> int:
    import dsjax
    from dsjax.bench.report import write_report
    from dsjax.tokenizer import load_tokenizer

    ks = [int(k) for k in str(args.k).split(",") if k]
    if not ks or min(ks) < 1:
        raise SystemExit("--k: draft lengths ≥ 1, comma-separated")
    tok = load_tokenizer("v4")
    prompts = held_out_prompts(tok, args.prompts, args.prompt_tokens, args.prompt_tokens + args.new_tokens)
    max_seq = -(-(args.prompt_tokens + 1 + args.new_tokens + max(ks) + 1) // 64) * 64
    model = dsjax.load(args.model, numerics=args.numerics, max_seq_len=max_seq, max_batch=len(prompts))
    if "random weights" in model.source:
        print("warning: random weights — acceptance on them is meaningless")

    def gen(**kw):
        t0 = time.perf_counter()
        out = model.generate(prompts, args.new_tokens, stop_token_ids=[], **kw)
        return out, time.perf_counter() - t0

    plain, plain_s = gen()
    rows = []
    for k in ks:
        spec, spec_s = gen(speculative="mtp", num_draft_tokens=k)
        same = [g.tokens == p.tokens for g, p in zip(spec, plain)]
        diffs = [first_difference(model, pr, p.tokens, g.tokens)
                 for pr, p, g, s in zip(prompts, plain, spec, same) if not s]
        steps = sum(g.stats["row_steps"] for g in spec)
        per_pos = np.mean([g.stats["acceptance_per_position"] for g in spec], axis=0)
        row = {"k": k, "acceptance_length": float(np.mean([g.stats["acceptance_length"] for g in spec])),
               "acceptance_length_pooled": sum(len(g.tokens) - 1 for g in spec) / steps,
               "acceptance_per_position": [round(float(x), 4) for x in per_pos],
               "identical_rows": int(sum(same)), "rows": len(same),
               "first_differences": [{"token": i, "logit_gap": round(gap, 4)} for i, gap in diffs],
               "wall_s_incl_compile": round(spec_s, 2)}
        rows.append(row)
        print(f"k={k}: acceptance length {row['acceptance_length']:.3f} (bonus included), per position "
              f"{row['acceptance_per_position']}; {row['identical_rows']}/{row['rows']} rows identical to plain "
              f"greedy" + (f"; first differences {row['first_differences']}" if diffs else ""), flush=True)
    write_report("accept", None, args.out, model=model.source, numerics=args.numerics, prompts=len(prompts),
                 prompt_tokens=args.prompt_tokens + 1, new_tokens=args.new_tokens,
                 prompt_source="held-out documents of dsjax train's corpus (never trained on)",
                 plain_wall_s_incl_compile=round(plain_s, 2), results=rows,
                 note="acceptance length = generated tokens after the first / verify steps, per row, mean over rows")
    return 0


if __name__ == "__main__":
    import sys

    from dsjax.bench.report import script_main

    sys.exit(script_main("dsjax.bench.accept", sys.argv[1:]))
