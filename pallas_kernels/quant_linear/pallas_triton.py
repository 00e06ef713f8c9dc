"""A dense linear is the routed-expert kernel's grouped GEMM with one group: every row of x belongs to "expert 0",
whose stack is the weight with a leading axis of 1 (`moe_gemm.pallas_triton.grouped_matmul`). The codes are read
in their stored format and decoded in registers (`common.weight_pieces`); at decode (a few rows) the contraction
is split so that out / block_o x splits programs fill the GPU, and the fp32 partials are summed in split order
outside (XLA), then rounded once."""

import dataclasses

import jax.numpy as jnp

from dsjax.kernels.common import round_bf, triton_interpret, triton_params
from dsjax.kernels.moe_gemm.pallas_triton import grouped_matmul, k_chunk
from dsjax.numerics import sum_in_order


def one_group(w):
    """The weight as a stack of one expert (no copy under jit: a reshape)."""
    return dataclasses.replace(w, weight=w.weight[None], scale=None if w.scale is None else w.scale[None])


def default_block_o(fmt: str, rows: int) -> int:
    return 32 if fmt == "fp4" and rows <= 64 else 64


def fits(w, n_in: int, block_o: int = 64, block_k: int = 128) -> bool:
    """Whether the tiles divide the weight: out by block_o, in by the contraction chunk."""
    return w.weight.shape[0] % block_o == 0 and n_in % k_chunk(w.fmt, w.block, block_k) == 0


def quant_linear(x, w, *, block_m: int | None = None, block_o: int | None = None, block_k: int = 128,
                 num_warps: int = 4, num_stages: int = 3, target_programs: int = 8 * 132, interpret=None,
                 fp4_asm: bool = True):
    """Row tiles of 16 up to 64 rows, 32 beyond; output tiles of 32 rows for FP4 at decode, 64 otherwise (the
    routed-expert kernel's H200 choices, docs/benchmarks.md; this op's own sweep is pending)."""
    dt = x.dtype
    if dt == jnp.float32 or w.fmt == "f32":
        raise ValueError("quant_linear pallas: bf16 compute only (fp32 numerics use the xla path)")
    n_out, n_in = w.weight.shape[0], x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, n_in)
    M = x2.shape[0]
    block_m = block_m or (16 if M <= 64 else 32)
    block_o = block_o or default_block_o(w.fmt, M)
    bk = k_chunk(w.fmt, w.block, block_k)
    if not fits(w, n_in, block_o, block_k):
        raise ValueError(f"quant_linear pallas: out {n_out} must be a multiple of block_o {block_o} and in {n_in} "
                         f"of the contraction chunk {bk}")
    T = -(-M // block_m)
    xp = jnp.pad(x2, ((0, T * block_m - M), (0, 0)))
    t = jnp.arange(T, dtype=jnp.int32)
    tiles = jnp.stack([jnp.zeros_like(t), t * block_m, jnp.full_like(t, M)], axis=1)
    (parts,) = grouped_matmul("quant_linear", xp, [one_group(w)], tiles, None, n_out, block_o, bk, block_m=block_m,
                              dt=dt, params=triton_params(num_warps, num_stages),
                              interpret=triton_interpret(interpret), target=target_programs, fp4_asm=fp4_asm)
    y = round_bf(sum_in_order(parts, axis=0), dt).astype(dt)[:M]
    return y.reshape(*lead, n_out)
