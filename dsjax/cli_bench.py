"""`dsjax bench ...`: the benchmark scripts as subcommands. Every one prints and saves a JSON report with its
command, machine, versions and date; none is a timed test."""

from __future__ import annotations

import argparse
import importlib

BENCHES = {
    "repro": ("dsjax.bench.repro", "the rival's Tetris run: one streamed greedy request, median of runs"),
    "ablate": ("dsjax.bench.ablate", "step time vs kernels, draft length, steps per dispatch, context, batch; "
                                     "the layer-slice proxy beside the roofline"),
    "prefill": ("dsjax.bench.prefill", "prompt tokens/s and MFU at 8k-128k on a layer slice; the 1M projection"),
    "tp": ("dsjax.bench.tp", "decode/verify step, prefill, all-reduce time and logits at several TP degrees"),
    "peer": ("dsjax.bench.peer", "transformers' DeepseekV4ForCausalLM and dsjax on the same GPU and weights"),
    "accept": ("dsjax.bench.accept", "MTP acceptance length for k = 1..4 on a trained checkpoint (default: the "
                                     "bundled dsjax-small) and speculative vs plain greedy identity"),
}


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks: repro, ablate, prefill, tp, peer (GPU); accept (any)",
                           description="Benchmarks. Each prints and saves a JSON report with its method.")
    kinds = bench.add_subparsers(dest="bench", required=True)
    for name, (module, text) in BENCHES.items():
        mod = importlib.import_module(module)
        p = kinds.add_parser(name, help=text, description=mod.__doc__,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_args(p)
        p.set_defaults(func=mod.run)
