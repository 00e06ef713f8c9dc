"""`dsjax train`: defaults are the H200 run (model "small"); `--smoke` is a CPU-sized run for CI and checks."""

from __future__ import annotations

import argparse
import json
import re
import os
import shlex
import shutil
import sys
import time


def add_train_parser(sub) -> None:
    p = sub.add_parser("train", help="train a small V4-architecture model and export it in the official layout",
                       description="Train a small DeepSeek-V4-architecture model (every layer kind, MTP head) on the "
                                   "Python standard library's sources + our HTML/JS, tokenised with the real tokenizer; "
                                   "resumable Orbax checkpoints in OUT/checkpoints, loss curve in OUT/loss_curve.png, "
                                   "the official-layout checkpoint in OUT/export.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="runs/train", help="run directory (rerun with the same --out to resume)")
    p.add_argument("--model", default="small", help="architecture: small (H200 run) or smoke (CPU)")
    p.add_argument("--vocab", type=int, default=6000, help="rows for the most frequent token ids (+ specials + 1)")
    p.add_argument("--steps", type=int, default=6000, help="length of the schedule (the most, with --time-budget)")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="wall seconds for the training loop, compile included: after timing its first steps the run "
                        "fixes its total (≤ --steps) so warmup + cosine end within the budget; kept for resumes")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--compute-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="activation dtype of the training forward (master weights stay fp32)")
    p.add_argument("--mtp-weight", type=float, default=0.3, help="weight of the MTP (token t+2) loss")
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-windows", type=int, default=64, help="held-out windows of --seq-len tokens")
    p.add_argument("--ckpt-every", type=int, default=500)
    p.add_argument("--held-out-percent", type=float, default=5.0, help="share of files held out")
    p.add_argument("--max-files", type=int, default=None, help="use only the first N stdlib files (sorted)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-export", action="store_true", help="skip writing OUT/export")
    p.add_argument("--prepare-only", action="store_true",
                   help="tokenise the corpus and build the vocabulary into OUT (corpus.npz, vocab_ids.npy), then stop: "
                        "a machine without this interpreter's stdlib can train from them")
    p.add_argument("--smoke", action="store_true",
                   help="a CPU smoke run: --model smoke, 30 steps of 4x64, 40 files, 256 vocabulary rows")
    p.set_defaults(func=cmd_train)


SMOKE = dict(model="smoke", steps=30, batch_size=4, seq_len=64, vocab=256, warmup=5, eval_every=15, eval_windows=8,
             ckpt_every=15, max_files=40)


def cmd_train(args) -> int:
    import jax
    import numpy as np

    from dsjax.params import init_params
    from dsjax.tokenizer import load_tokenizer
    from dsjax.train import corpus, export, loop, vocab
    from dsjax.train.loss import merge, train_config, with_vocab, zero_gate_bias
    from dsjax.train.models import model_config

    argv = sys.argv[1:] if sys.argv and sys.argv[0].endswith("dsjax") else None
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
    command = "dsjax " + shlex.join(argv) if argv else "dsjax train --smoke" if args.smoke else "dsjax train"
    os.makedirs(args.out, exist_ok=True)
    tok = load_tokenizer("v4")
    t0 = time.perf_counter()
    train_stream, held_stream, info = corpus.load_splits(
        tok, held_out_percent=args.held_out_percent, max_files=args.max_files,
        cache=os.path.join(args.out, "corpus.npz"))
    vocab_path = os.path.join(args.out, "vocab_ids.npy")
    if os.path.exists(vocab_path):
        vocab_ids = np.load(vocab_path)
    else:
        vocab_ids = vocab.build(train_stream, args.vocab, vocab.chat_special_ids(tok))
        np.save(vocab_path, vocab_ids)
    cov = vocab.coverage(vocab_ids, held_stream)
    print(f"corpus: {len(train_stream):,} train / {len(held_stream):,} held-out tokens from {info['files_train']} / "
          f"{info['files_held_out']} files ({time.perf_counter() - t0:.1f} s); {len(vocab_ids):,} vocabulary rows "
          f"cover {cov:.2%} of held-out tokens", flush=True)
    if args.prepare_only:
        return 0
    cfg = model_config(args.model, len(vocab_ids))
    tcfg = train_config(cfg, args.compute_dtype)
    params = zero_gate_bias(with_vocab(init_params(tcfg, args.seed), vocab_ids))
    settings = loop.TrainSettings(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                                  warmup_steps=args.warmup, weight_decay=args.weight_decay, mtp_weight=args.mtp_weight,
                                  eval_every=args.eval_every, eval_windows=args.eval_windows,
                                  ckpt_every=args.ckpt_every, seed=args.seed, time_budget_s=args.time_budget)
    n_params = param_count(cfg)
    print(f"model {cfg.name}: {n_params:,} parameters; {settings.steps} steps of {settings.batch_size}x"
          f"{settings.seq_len}", flush=True)
    train, frozen, history = loop.train(tcfg, params, train_stream, held_stream, settings, args.out)
    if args.no_export:
        return 0
    dst = os.path.join(args.out, "export")
    if os.path.exists(dst):
        shutil.rmtree(dst)
    windows = corpus.eval_windows(held_stream, settings.eval_windows, settings.seq_len)
    last_eval = history["eval"][-1] if history["eval"] else {}
    best = min(history["eval"], key=lambda r: r["main"]) if history["eval"] else {"main": float("nan"), "step": 0}
    fp32 = export.held_out_loss_params(merge(train, frozen), tcfg, windows, batch=min(8, len(windows)))
    qparams = export.quantise(merge(train, frozen), cfg)
    readme_info = dict(
        name=cfg.name, n_layers=cfg.n_layers, ratios=list(cfg.compress_ratios[:cfg.n_layers]), n_hash=cfg.n_hash_layers,
        k=cfg.n_activated_experts, E=cfg.n_routed_experts, hc=cfg.hc_mult, dim=cfg.dim, params=n_params,
        rows=len(vocab_ids), n_freq=args.vocab, coverage=cov,
        data=f"the Python {info['python']} standard library's .py sources (PSF "
             f"licence; test suites included, site-packages and files over 256 KB excluded) + dsjax's own HTML/JS; {info['files_train']} "
             f"train / {info['files_held_out']} held-out files (split by crc32 of the path, "
             f"{args.held_out_percent}% held out); {len(train_stream):,} train tokens",
        steps=history["steps"], batch=settings.batch_size, seq=settings.seq_len,
        tokens=history["steps"] * settings.batch_size * settings.seq_len, lr=settings.lr, warmup=settings.warmup_steps,
        min_lr_ratio=settings.min_lr_ratio, wd=settings.weight_decay, compute=args.compute_dtype, mtp_w=settings.mtp_weight,
        eval_tokens=fp32["tokens"], eval_windows=len(windows), fp32_main=fp32["loss"],
        obj_main=last_eval.get("main", float("nan")), obj_mtp=last_eval.get("mtp", float("nan")),
        numerics="reference-bf16", loaded=float("nan"), command=command,
        reproduce=re.sub(r"--time-budget[ =]\S+", f"--steps {history['steps']}", command),
        train_s=history["train"][-1]["time_s"] if history["train"] else 0.0, device=jax.devices()[0].device_kind,
        best_main=best["main"], best_step=best["step"])
    size = export.write(dst, qparams, cfg)
    loaded = export.held_out_loss_loaded(dst, windows, batch=min(8, len(windows)))
    readme_info["loaded"] = loaded["loss"]
    export.write_readme(dst, export.README.format(**readme_info),
                        {**readme_info, "held_out_loaded": loaded, "checkpoint_bytes": size, "jax": jax.__version__})
    for f in ("loss_curve.png", "history.json"):
        shutil.copy(os.path.join(args.out, f), os.path.join(dst, f))
    print(json.dumps({"export": dst, "checkpoint_bytes": size, "held_out_fp32": fp32, "held_out_loaded": loaded}))
    return 0


def param_count(cfg) -> int:
    """Parameters of `cfg` (unpacked logical shapes; scales and integer tables not counted)."""
    import jax
    import numpy as np

    from dsjax.weights import describe, is_info

    total = 0
    for path, i in jax.tree_util.tree_leaves_with_path(describe(cfg), is_leaf=is_info):
        key = jax.tree_util.keystr(path)
        if (key.endswith(".scale") and np.dtype(i.dtype) == np.uint8) or np.issubdtype(np.dtype(i.dtype), np.integer) \
                and "weight" not in key:
            continue
        total += int(np.prod(i.logical_shape or i.shape))
    return total
