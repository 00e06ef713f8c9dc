"""FP8 activation codes in one kernel: `quant.fp8_e4m3_codes(x, block)` as one Triton program per 16 scale blocks.

Why: XLA runs that quantization as three kernels (the blocks' amax, the power-of-two scales, the codes), and the
MoE op quantizes x and h at every call — at one decode token six of its thirteen kernels, ~6 µs on the H200
(docs/benchmarks.md, "The fused epilogue"). The GEMM kernels cannot do it themselves without repeating it in every
program of a tile (measured slower: `in_kernel_quant`), so it runs once, here. Same numbers, bit for bit
(`quant.fp8_e4m3_row_codes`).
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from dsjax import quant
from dsjax.kernels.common import gather, iota, triton_interpret, triton_params

ROWS = 16       # scale blocks a program


def fp8_codes(x, block: int, interpret=None):
    """x [R, C] (C a multiple of block) -> (e4m3 codes [R, C], fp32 power-of-two scales [R, C / block]), equal to
    `quant.fp8_e4m3_codes(x, block)`."""
    R, C = x.shape
    if C % block:
        raise ValueError(f"fp8_codes: {C} columns are not whole scale blocks of {block}")
    blocks = x.reshape(R * C // block, block)          # a bitcast: each row one scale block
    n = blocks.shape[0]

    def body(x_ref, codes_ref, scales_ref):
        r = iota(ROWS, pl.program_id(0) * ROWS)
        ok = r < n
        cols = iota(block)[None, :]
        tile = gather(x_ref, r[:, None], cols, mask=ok[:, None]).astype(jnp.float32)
        codes, scales = quant.fp8_e4m3_row_codes(tile)
        plt.store(codes_ref.at[r[:, None], cols], codes, mask=ok[:, None])
        plt.store(scales_ref.at[r], scales, mask=ok)

    codes, scales = pl.pallas_call(
        body,
        out_shape=(jax.ShapeDtypeStruct((n, block), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((n,), jnp.float32)),
        grid=(pl.cdiv(n, ROWS),), compiler_params=triton_params(4, 1), interpret=triton_interpret(interpret),
        name="moe_act_codes")(blocks)
    return codes.reshape(R, C), scales.reshape(R, C // block)
