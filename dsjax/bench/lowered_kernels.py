"""The MoE expert op's Mosaic GPU kernels as lowered on this CPU for an abstract H200, printed without debug info,
with a hash each — whether an edit changed a kernel's code, answered without a GPU — and each kernel's shared
memory a program, so how many programs an SM's shared memory holds (ncu's "Block Limit Shared Mem").

Why: the lowered module carries source lines in its locations, so any edit above a kernel changes the module's
bytes; with the locations dropped, two lowerings of the same kernel code print the same text. How the session of
2026-12-05 showed that the default FP4 kernels were byte for byte the GPU-tested ones after the opt-in
`stream_scales` and the shared side buffer went in (docs/kernels.md), with no device time left to rerun them.

    python -m dsjax.bench.lowered_kernels                                   # V4-Flash decode, 8 tokens, defaults
    python -m dsjax.bench.lowered_kernels --tokens 1 --configs '[{}, {"mosaic_quad_waits": true}]'
    python -m dsjax.bench.lowered_kernels --shapes v41 --out /tmp/kernels  # + each kernel's MLIR text

Compare the hashes printed at two commits (e.g. in two `git worktree`s installed side by side).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys

import jax
import jax.numpy as jnp

SMEM_PER_SM = 228 * 1024    # an H100's or H200's shared memory for its programs
SMEM_RESERVED = 1024        # what the driver keeps of it a program
SHAPES = {"v4": (256, 4096, 2048), "v41": (384, 5120, 2304), "tiny": (8, 512, 256)}   # experts, model, expert dims
_MODULE = re.compile(r'module = "((?:[^"\\]|\\.)*)"')
_DUMP_NAME = re.compile(r'mosaic_gpu\.dump_basename = "[^"]*"')     # a per-process counter, not the kernel's code


def lower_for_h200(f, *args) -> str:
    """Runs the Pallas lowering (Mosaic GPU: wgmma, SMEM transforms, layout inference; Triton: the TTIR module) of
    jitted f under an abstract H200 (jax-anchors §8.5) and returns the StableHLO text holding the kernels' custom
    calls. PTX and the cubin are built later, at XLA compile time, by the CUDA plugin."""
    mesh = jax.sharding.AbstractMesh((), (), abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _unescape(text: str) -> bytes:
    """The StableHLO printer's string escapes (\\XX hex bytes, \\\\, \\") back to bytes."""
    out, i = bytearray(), 0
    while i < len(text):
        if text[i] != "\\":
            out += text[i].encode()
            i += 1
        elif text[i + 1] in '\\"':
            out.append(ord(text[i + 1]))
            i += 2
        else:
            out.append(int(text[i + 1:i + 3], 16))
            i += 3
    return bytes(out)


def mosaic_modules(stablehlo_text: str) -> list[str]:
    """Each Mosaic GPU kernel's module in the text (serialized MLIR bytecode), printed without debug info and
    without its dump name (a counter of the kernels lowered so far in this process)."""
    from jax._src.interpreters import mlir
    from jax._src.lib import mosaic_gpu_dialect
    from jaxlib.mlir import ir

    printed = []
    for escaped in _MODULE.findall(stablehlo_text):
        ctx = mlir.make_ir_context()
        mosaic_gpu_dialect.register_dialect(ctx)
        ctx.allow_unregistered_dialects = True        # the kernels' versioned (stable_mosaic_gpu) ops print generically
        with ctx:
            asm = ir.Module.parse(_unescape(escaped)).operation.get_asm(enable_debug_info=False)
        printed.append(_DUMP_NAME.sub('mosaic_gpu.dump_basename = "-"', asm))
    return printed


def launch_smem_bytes(asm: str) -> int:
    """A kernel's dynamic shared memory a program (scratch and barriers): the launch's last operand, a constant."""
    operands = re.search(r'"(?:stable_mosaic_gpu\.)?gpu\.launch"\(([^)]*)\)', asm).group(1)
    name = re.escape(operands.split(",")[-1].strip())
    return int(re.search(name + r' = "(?:stable_mosaic_gpu\.)?arith\.constant"\(\) \{value = (\d+)', asm).group(1))


def programs_per_sm_by_smem(smem_bytes: int) -> int:
    """Programs of this much dynamic shared memory one SM holds at once (registers and warps may allow fewer)."""
    return SMEM_PER_SM // (smem_bytes + SMEM_RESERVED)


def lower_moe(E: int, D: int, I: int, tokens: int, options: dict, act_quant_sim: bool = True) -> str:
    """The StableHLO text of the FP4 expert op (top-6 of E experts, D -> I -> D, the Mosaic kernels with these
    `moe_gemm` options) for `tokens` tokens, lowered for an abstract H200."""
    from dsjax.kernels.moe_gemm.api import moe_gemm
    from dsjax.weights import Linear

    S = jax.ShapeDtypeStruct
    lin = lambda o, i: Linear(S((E, o, i // 2), jnp.uint8), S((E, o, i // 32), jnp.uint8), "fp4", 32)  # noqa: E731

    def f(x, w, ids, w1, w3, w2):
        return moe_gemm(x, w, ids, w1, w3, w2, swiglu_limit=10.0, act_quant_sim=act_quant_sim, act_quant_block=128,
                        implementation="pallas", interpret=False, fp4_kernel="mosaic", **options)
    return lower_for_h200(f, S((tokens, D), jnp.bfloat16), S((tokens, 6), jnp.float32), S((tokens, 6), jnp.int32),
                          lin(I, D), lin(I, D), lin(D, I))


def moe_kernels(shapes: str, tokens: int, options: dict, activations: str = "fp8") -> list[str]:
    """The FP4 expert op's Mosaic kernels (up, then down) at these shapes and options, without debug info."""
    return mosaic_modules(lower_moe(*SHAPES[shapes], tokens, options, act_quant_sim=activations == "fp8"))


def digest(asm: str) -> str:
    return hashlib.sha256(asm.encode()).hexdigest()[:16]


def main(argv=None) -> int:
    from dsjax.bench.kernels import moe_option_list, token_counts

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="v4", choices=tuple(SHAPES), help="V4-Flash's, V4.1-Flash's or tiny experts")
    p.add_argument("--tokens", default=[8], type=token_counts, help="token counts (comma-separated, default 8)")
    p.add_argument("--activations", default="fp8", choices=("fp8", "bf16"), help="FP8 codes or bf16 values")
    p.add_argument("--configs", default="[{}]", type=moe_option_list,
                   help="JSON list of Pallas kernel options (moe_gemm keywords), one lowering each")
    p.add_argument("--out", default=None, help="also write each kernel's MLIR text into this folder")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    for n in args.tokens:
        for options in args.configs:
            kernels = moe_kernels(args.shapes, n, options, args.activations)
            smem = [launch_smem_bytes(k) for k in kernels]
            row = dict(shapes=args.shapes, tokens=n, activations=args.activations, options=options,
                       kernels=[dict(sha256=digest(k), chars=len(k), smem_bytes=b,
                                     programs_per_sm_by_smem=programs_per_sm_by_smem(b))
                                for k, b in zip(kernels, smem)])
            print(json.dumps(row), flush=True)
            if args.out:
                import pathlib
                folder = pathlib.Path(args.out)
                folder.mkdir(parents=True, exist_ok=True)
                tag = f"{args.shapes}-{n}-{args.activations}-{digest(json.dumps(options, sort_keys=True))[:8]}"
                for i, k in enumerate(kernels):
                    (folder / f"{tag}-kernel{i}.mlir").write_text(k)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
