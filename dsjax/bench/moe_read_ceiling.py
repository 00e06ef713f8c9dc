"""How fast can the MoE op's expert weights be read at all, in the grids of its two Mosaic kernels?

Issue 8 asks ≥ 75% of the copy rate at 1-8 decode tokens. At one token the whole op must then take ~25 µs
(80 MB), and its two FP4 GEMM kernels already take ~34 µs (docs/benchmarks.md, the 12-04 profiles): is the gap
the kernels' work (FP4 decode, wgmma, scales, the pipeline's waits) or the shape itself (192 programs of 16
serial 256-column steps, two launches)? This times kernels that do only the loads — the same grid, BlockSpec,
tiling, swizzle and pipeline stages as `moe_gemm.mosaic_fp4.tile_gemm`, each step XOR-ing its words into a
register carry (the codes only: the GEMMs' block scales add 1/16 of their bytes) — for the up projection (gate +
up, K = D) and the down projection (K = I) of the distinct experts a random top-k routing of n tokens picks, one
launch each and both in one jit, beside the torch copy rate of the same run. If the read-only pair is itself under
75%, no kernel of this shape meets the target, and the next design is a different grid (more programs, a K split,
one persistent launch: `programs`), not a faster step. `tiled` reads the same words from weights laid out once so
that each step's box is contiguous (`tile_major`): does the stored layout's page pattern cost reads?

    python -m dsjax.bench.moe_read_ceiling --tokens 1,2,4,8 --configs '[{}, {"stages": 3}, {"k_splits": 2}]'
    python -m dsjax.bench.moe_read_ceiling --configs '[{"programs": 132}, {"programs": 132, "stages": 4}]'
    python -m dsjax.bench.moe_read_ceiling --configs '[{"decode": true}, {"programs": 132, "decode": true}]'
    python -m dsjax.bench.moe_read_ceiling --tokens 1,2,8 --configs '[{"programs": 132, "stages": 4}]'  # + one launch
    python -m dsjax.bench.moe_read_ceiling --configs '[{}, {"tiled": true}]'
    python -m dsjax.bench.moe_read_ceiling --smoke        # tiny shapes, interpreted (a CPU check)

Prints µs per launch and the share of the copy rate; --out writes JSON lines. With `programs`, a fourth part,
"one launch": both projections' reads in one persistent launch, each program its share of the up steps then of
the down steps — the read side of a one-launch op (docs/kernels.md).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from dsjax.kernels.common import every_bit, fp4_e4m3_words, fp4_words, gpu_interpret
from dsjax.kernels.moe_gemm.mosaic_fp4 import ROWS, WORDS_LAYOUT, expert_rows, weight_block_spec, weight_spec

READ_OPTIONS = ("block_k", "stages", "k_splits", "programs", "decode", "tiled")


def absorb(acc, words, decode: bool):
    """One Linear's step words into the carry: XOR-ed (the loads alone), or with `decode` through the kernels' FP4
    -> e4m3 bit moves (`fp4_e4m3_words`), the even word XOR-ed and the odd added (so neither can be dropped)."""
    if not decode:
        return acc ^ words
    even, odd = fp4_e4m3_words(words)
    return (acc ^ even) + odd


def tile_major(words, block_k: int = 256):
    """u32 [E, n_out, K / 8] -> [E, n_out / 64, K / block_k, 64, block_k / 8]: the same words, each program step's
    box (64 rows x one step's words: 8 KB at 256 columns) one contiguous run of memory instead of 64 runs of 128
    bytes, 2 KB apart at K = 4,096 (the stored layout). Do the reads pace by the DRAM pages each step opens?"""
    E, n_out, Kw = words.shape
    W = block_k // 8
    return words.reshape(E, n_out // ROWS, ROWS, Kw // W, W).transpose(0, 1, 3, 2, 4)


def read_words(stacks, experts, *, block_k: int = 256, stages: int = 2, k_splits: int = 1, programs: int = 0,
               decode: bool = False, interpret=None):
    """The loads of `tile_gemm`'s weight pipeline alone. stacks: u32 words [E, n_out, K / 8] (one per Linear a
    program reads: gate and up, or down); experts int32 [T] (-1: a tile that reads nothing). -> u32 [T, k_splits,
    n_out, block_k / 8]: every word a program read folded in by `absorb` (so no load can be dropped), in step
    order, by row and word slot. decode: also the GEMMs' FP4 decode (its ALU work, without the MMAs).
    programs > 0: the persistent shape instead (`read_words_persistent`). Stacks in `tile_major` layout (5-D) are
    read box by box from it: the same words a program and step, so the same result."""
    if programs:
        if k_splits != 1:
            raise ValueError("moe_read_ceiling: a persistent launch splits the steps itself (k_splits must be 1)")
        return read_words_persistent(stacks, experts, programs=programs, block_k=block_k, stages=stages,
                                     decode=decode, interpret=interpret)
    tiled = stacks[0].ndim == 5
    W = block_k // 8
    if tiled:
        if stacks[0].shape[-1] != W:
            raise ValueError(f"moe_read_ceiling: tile_major stacks of {stacks[0].shape[-1]}-word steps, not {W}")
        E, R, S = stacks[0].shape[:3]
        n_out, Kw = R * ROWS, S * W
    else:
        E, n_out, Kw = stacks[0].shape
    if n_out % ROWS or Kw % (W * k_splits):
        raise ValueError(f"moe_read_ceiling: n_out {n_out} must be a multiple of {ROWS} and the {Kw} words a row "
                         f"whole steps of {W} for each of {k_splits} splits")
    steps = Kw // W // k_splits
    T, n = experts.shape[0], len(stacks)
    interp = plgpu.InterpretGPUParams() if interpret is True else gpu_interpret(interpret)

    def body(e_ref, *refs):
        w_refs, out_ref, e_s, o_s, bar = refs[:n], refs[n], refs[n + 1], refs[n + 2], refs[n + 3]
        t, r, split = lax.axis_index("t"), lax.axis_index("r"), lax.axis_index("s")
        plgpu.copy_gmem_to_smem(e_ref.at[t], e_s, bar.at[0])
        plgpu.barrier_wait(bar.at[0])
        e = e_s[0]

        @pl.when(e >= 0)
        def _tile():
            def step(_, *refs_and_carry):
                acc = refs_and_carry[n]
                for w_s in refs_and_carry[:n]:
                    acc = absorb(acc, plgpu.load(w_s, layout=WORDS_LAYOUT), decode)
                return acc

            spec = (weight_block_spec(W, lambda k: (e, r, split * steps + k, 0, 0), squeezed=3) if tiled
                    else weight_spec(W, e, r, split * steps))
            zero = plgpu.layout_cast(jnp.zeros((ROWS, W), jnp.uint32), WORDS_LAYOUT)
            acc = plgpu.emit_pipeline(step, grid=(steps,), in_specs=[spec] * n, max_concurrent_steps=stages,
                                      init_carry=zero)(*w_refs)
            o_s[...] = acc
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_s, out_ref.at[t, split, pl.ds(r * ROWS, ROWS)])
            plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((T, k_splits, n_out, W), jnp.uint32),
        grid=(T, n_out // ROWS, k_splits), grid_names=("t", "r", "s"),
        scratch_types=[plgpu.SMEM((4,), jnp.int32), plgpu.SMEM((ROWS, W), jnp.uint32),
                       plgpu.Barrier(num_barriers=1)],
        interpret=interp)
    return kernel(expert_rows(experts), *stacks)


def read_words_persistent(stacks, experts, *, programs: int, block_k: int = 256, stages: int = 2,
                          decode: bool = False, interpret=None):
    """One launch of `programs` programs (e.g. one an SM) streaming every tile's (64-row block, step) loads in turn
    through ONE pipeline each — program p takes global steps [p·per, (p+1)·per) of the T x row blocks x steps in
    that order, so no pipeline drains and refills at a tile's end, and no wave is left part-empty. -> u32
    [programs, 64, block_k / 8]: every word a program read folded in by `absorb`, in step order (an unused tile's
    loads are made, of expert 0, and folded in as zeros)."""
    return read_words_one_launch([stacks], experts, programs=programs, block_k=block_k, stages=stages,
                                 decode=decode, interpret=interpret)[0]


def read_words_one_launch(groups, experts, *, programs: int, block_k: int = 256, stages: int = 2,
                          decode: bool = False, interpret=None):
    """`read_words_persistent` for several groups of stacks in ONE launch — the up projection's [gate, up], then
    the down projection's [down]: each program reads its share of the first group's steps through one pipeline,
    then its share of the next group's through another, with no launch between (loads only, so no barrier: the
    read side of a one-launch op). -> u32 [groups, programs, 64, block_k / 8], each group as
    `read_words_persistent` folds it."""
    W = block_k // 8
    for stacks in groups:
        E, n_out, Kw = stacks[0].shape
        if n_out % ROWS or Kw % W:
            raise ValueError(f"moe_read_ceiling: n_out {n_out} must be a multiple of {ROWS} and the {Kw} words a "
                             f"row whole steps of {W}")
    T = experts.shape[0]
    sizes = [len(stacks) for stacks in groups]
    interp = plgpu.InterpretGPUParams() if interpret is True else gpu_interpret(interpret)

    def body(e_ref, *refs):
        n_all = sum(sizes)
        out_ref, e_s, o_s, bar = refs[n_all:]
        p = lax.axis_index("p")
        plgpu.copy_gmem_to_smem(e_ref, e_s, bar.at[0])
        plgpu.barrier_wait(bar.at[0])
        start = 0
        for g, stacks in enumerate(groups):
            w_refs, n = refs[start:start + sizes[g]], sizes[g]
            start += n
            R, S = stacks[0].shape[1] // ROWS, stacks[0].shape[2] // W
            U = T * R * S
            per = -(-U // programs)
            first = p * per
            count = jnp.clip(U - first, 0, per)

            def tile_of(i, first=first, U=U, R=R, S=S):   # step i of this program -> (tile, row block, column block)
                q = jnp.minimum(first + i, U - 1)           # a program past the end reads the last step once
                return q // (R * S), q // S % R, q % S

            def index_map(i, tile_of=tile_of):
                t, r, k = tile_of(i)
                return jnp.maximum(e_s[t, 0], 0), r, k

            def step(idx, *refs_and_carry, n=n, tile_of=tile_of):
                acc = refs_and_carry[n]
                keep = every_bit(e_s[tile_of(idx[0])[0], 0] >= 0)
                for w_s in refs_and_carry[:n]:
                    acc = absorb(acc, plgpu.load(w_s, layout=WORDS_LAYOUT) & keep, decode)
                return acc

            zero = plgpu.layout_cast(jnp.zeros((ROWS, W), jnp.uint32), WORDS_LAYOUT)
            acc = plgpu.emit_pipeline(step, grid=(jnp.maximum(count, 1),),
                                      in_specs=[weight_block_spec(W, index_map)] * n,
                                      max_concurrent_steps=stages, init_carry=zero)(*w_refs)
            plgpu.wait_smem_to_gmem(0)                      # the group before has read o_s
            o_s[...] = acc & every_bit(count > 0)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_s, out_ref.at[g, p])
        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((len(groups), programs, ROWS, W), jnp.uint32), grid=(programs,),
        grid_names=("p",),
        scratch_types=[plgpu.SMEM((T, 4), jnp.int32), plgpu.SMEM((ROWS, W), jnp.uint32),
                       plgpu.Barrier(num_barriers=1)],
        interpret=interp)
    return kernel(expert_rows(experts), *[st for stacks in groups for st in stacks])


def read_words_persistent_reference(stacks, experts, *, programs: int, block_k: int = 256, decode: bool = False):
    """`read_words_persistent`'s contract, folded step by step on the host."""
    W = block_k // 8
    E, n_out, Kw = stacks[0].shape
    R, S = n_out // ROWS, Kw // W
    stacks = [np.asarray(st) for st in stacks]
    experts = np.asarray(experts)
    U = len(experts) * R * S
    per = -(-U // programs)
    out = np.zeros((programs, ROWS, W), np.uint32)
    for p in range(programs):
        acc = jnp.zeros((ROWS, W), jnp.uint32)
        for g in range(p * per, min(U, (p + 1) * per)):
            e, r, k = experts[g // (R * S)], g // S % R, g % S
            for st in stacks:
                acc = absorb(acc, st[max(e, 0), r * ROWS:(r + 1) * ROWS, k * W:(k + 1) * W] * np.uint32(e >= 0), decode)
        out[p] = np.asarray(acc)
    return out


def read_words_reference(stacks, experts, *, block_k: int = 256, k_splits: int = 1, decode: bool = False):
    """`read_words`' contract, folded step by step on the host: per used tile [k_splits, n_out, W] (None unused)."""
    W = block_k // 8
    stacks = [np.asarray(st) for st in stacks]
    n_out, Kw = stacks[0].shape[1:]
    steps = Kw // W // k_splits
    out = []
    for e in np.asarray(experts):
        if e < 0:
            out.append(None)
            continue
        splits = []
        for sp in range(k_splits):
            acc = jnp.zeros((n_out, W), jnp.uint32)
            for k in range(sp * steps, (sp + 1) * steps):
                for st in stacks:
                    acc = absorb(acc, st[e, :, k * W:(k + 1) * W], decode)
            splits.append(np.asarray(acc))
        out.append(np.stack(splits))
    return out


def weight_words(key, E: int, n_out: int, K: int):
    """Random FP4 codes as the kernels read them: u32 [E, n_out, K / 8] (8 codes a word)."""
    codes = jax.random.randint(key, (E, n_out, K // 2), 0, 256, jnp.int32).astype(jnp.uint8)
    return fp4_words(codes)


def read_option_list(text: str) -> list[dict]:
    """argparse `type`: a JSON list of `read_words` options (`READ_OPTIONS`)."""
    from dsjax.bench.kernels import option_list

    return option_list(text, READ_OPTIONS)


def measure(n: int, n_experts: int, cfg: dict, experts, stacks, dims, copy, smoke: bool) -> list[dict]:
    """The up launch, the down launch and both in one jit, timed on the device (one dispatch, many calls); with
    `programs`, also both projections' reads in one persistent launch (`read_words_one_launch`)."""
    from dsjax.bench.kernels import time_us_looped

    gate, up, down = stacks
    D, I = dims
    opts = dict(cfg, interpret=True) if smoke else dict(cfg)
    if opts.pop("tiled", False):                # the weights laid out once, before any timing
        if cfg.get("programs"):
            raise ValueError("moe_read_ceiling: tiled is a tile grid option (programs 0)")
        gate_t, up_t, down_t = (jax.block_until_ready(tile_major(st, cfg.get("block_k", 256))) for st in stacks)
    else:
        gate_t, up_t, down_t = stacks
    up_fn = jax.jit(lambda g, u, x: read_words([g, u], x, **opts))
    down_fn = jax.jit(lambda d, x: read_words([d], x, **opts))
    both_fn = jax.jit(lambda g, u, d, x: (read_words([g, u], x, **opts), read_words([d], x, **opts)))
    persistent = {k: v for k, v in opts.items() if k != "k_splits"}
    one_fn = jax.jit(lambda g, u, d, x: read_words_one_launch([[g, u], [d]], x, **persistent))
    if smoke:                                   # the contract, on the interpreter, with an unused tile last
        tiles = jnp.append(experts, -1)
        got = up_fn(gate_t, up_t, tiles)
        ref_opts = {k: v for k, v in cfg.items() if k not in ("stages", "programs", "tiled")}
        if cfg.get("programs"):
            want = read_words_persistent_reference([gate, up], tiles, programs=cfg["programs"], **ref_opts)
            np.testing.assert_array_equal(np.asarray(got), want)
            got_one = one_fn(gate, up, down, tiles)
            for g, stacks in enumerate(([gate, up], [down])):
                np.testing.assert_array_equal(np.asarray(got_one[g]), read_words_persistent_reference(
                    stacks, tiles, programs=cfg["programs"], **ref_opts))
        else:
            for tile_got, tile_want in zip(got, read_words_reference([gate, up], tiles, **ref_opts)):
                if tile_want is not None:
                    np.testing.assert_array_equal(np.asarray(tile_got), tile_want)
    nbytes = {"up": n_experts * 2 * I * D // 2, "down": n_experts * D * I // 2}     # FP4 codes: half a byte each
    nbytes["both"] = nbytes["one launch"] = nbytes["up"] + nbytes["down"]
    timer = functools.partial(time_us_looped, **(dict(repeat=1, rounds=1) if smoke else {}))
    calls = {"up": (lambda x, g, u: up_fn(g, u, x), (experts, gate_t, up_t)),
             "down": (lambda x, d: down_fn(d, x), (experts, down_t)),
             "both": (lambda x, g, u, d: both_fn(g, u, d, x), (experts, gate_t, up_t, down_t))}
    if cfg.get("programs"):                     # both projections' reads in one persistent launch
        calls["one launch"] = (lambda x, g, u, d: one_fn(g, u, d, x), (experts, gate, up, down))
    out = []
    for part, (fn, args) in calls.items():
        us = timer(fn, *args)
        kernel_us = None if smoke else read_kernels_us(fn, args)
        share = lambda t: None if copy is None or not t else nbytes[part] / (t * 1e-6) / (copy * 1e9)  # noqa: E731
        out.append(dict(tokens=n, experts=n_experts, options=cfg, part=part, us=us, kernel_us=kernel_us,
                        bytes=nbytes[part], copy_share=share(us), kernel_copy_share=share(kernel_us)))
        print(f"{n} tokens ({n_experts} experts) {json.dumps(cfg)} {part}: {us:.1f} µs, {nbytes[part] / 1e6:.1f} MB"
              + ("" if share(us) is None else f", {share(us):.1%} of the copy rate")
              + ("" if kernel_us is None else f"; its kernels alone {kernel_us:.1f} µs ({share(kernel_us):.1%})"))
    return out


def read_kernels_us(fn, args) -> float:
    """The Mosaic kernels' own time per call, from a profiler trace: the looped timer's per-call floor (the loop,
    the expert-row pad) left out, as `moe_profile` times the GEMM kernels."""
    from dsjax.bench.profile import kernel_times

    times, _ = kernel_times(jax.jit(fn), args, reps=20)
    ours = sum(us for name, us in times.items() if "mpmd" in name or "mosaic" in name or "pallas" in name)
    return ours or sum(times.values()) or None          # unnamed as expected: every kernel of the call


def main(argv=None) -> int:
    from dsjax.bench.kernels import moe_shapes, token_counts
    from dsjax.bench.report import run_info
    from dsjax.bench.roofline import torch_roofline

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default=[1, 2, 4, 8], type=token_counts, help="token counts (default 1,2,4,8)")
    p.add_argument("--configs", default="[{}]", type=read_option_list,
                   help=f"JSON list of option sets ({', '.join(READ_OPTIONS)}); {{}} = the GEMM kernels' defaults")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, interpreted kernels (a CPU check)")
    p.add_argument("--out", default=None, help="append JSON lines here")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    argv_list = sys.argv[1:] if argv is None else argv

    E, D, I, k = (16, 512, 512, 6) if args.smoke else moe_shapes(False)     # smoke: two 256-column steps a row
    roof = torch_roofline()
    copy = roof.get("copy_GBps")
    k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
    gate, up, down = weight_words(k1, E, I, D), weight_words(k2, E, I, D), weight_words(k3, E, D, I)
    lines = [dict(run_info("moe_read_ceiling", argv_list), roofline=roof, shapes=dict(E=E, D=D, I=I, k=k))]
    print(f"copy rate {copy if copy is None else round(copy, 1)} GB/s (torch, this run)")
    for n in args.tokens:
        rng = np.random.default_rng(n)
        picked = np.unique(np.concatenate([rng.permutation(E)[:k] for _ in range(n)]))
        experts = jnp.asarray(picked, jnp.int32)
        for cfg in args.configs:
            try:
                lines += measure(n, len(picked), cfg, experts, (gate, up, down), (D, I), copy, args.smoke)
            except ValueError as e:                 # an option set the kernel refuses: reported, not fatal
                print(f"{n} tokens {json.dumps(cfg)}: {e}")
                lines.append(dict(tokens=n, options=cfg, error=str(e)))
    if args.out:
        with open(args.out, "a") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
