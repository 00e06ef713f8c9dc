"""The mHC split + Sinkhorn as one Triton-lowered kernel: a program per block of rows (tokens).

Every quantity is a [block_rows] vector: the n pre gates, the n post gates and the n² comb entries (column c of
m loaded as its own vector), so the row and column sums of the n x n matrices are sums of n vectors and all
`iters` iterations run unrolled in registers — no reshapes, no shared memory, one read of m, one write of the
results. Division is Triton's fp32 divide (within 2 ulp of IEEE on the GPU); the fp32 mixes it normalises are
re-normalised every iteration, so the difference does not grow (the tests bound it).
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dsjax.kernels.common import check_offsets, gather, iota, pad_axis, triton_interpret, triton_params


def _sigmoid(x):
    return 1.0 / (1.0 + jnp.exp(-x))


SMALL_BLOCK = 32  # rows: decode and verify calls fit one such program


def mhc_sinkhorn(m, scale, base, *, n: int, iters: int, eps: float, block_rows: int | None = None,
                 num_warps: int | None = None, reciprocal: bool = False, interpret=None):
    """block_rows / num_warps: by default one 32-row, one-warp program for ≤ 32 rows (decode / verify: 16 vs 22 µs a
    one-row call on the H200, where 256 rows x 4 warps computed 255 padding rows), 256 rows x 4 warps above.
    reciprocal: normalise by one reciprocal per row / column sum and n multiplies instead of n fp32 divides
    (a divide is ~10 instructions; 640 of them per row make the one-row decode call latency-bound, 36 µs in the
    V4.1 slice profile). Off until timed on the GPU (`bench kernels --ops mhc` times both)."""

    def normalise(xs, total):
        """Each of xs over total: by one reciprocal and multiplies, or by divides."""
        if reciprocal:
            inv = 1.0 / total
            return [x * inv for x in xs]
        return [x / total for x in xs]

    lead, width = m.shape[:-1], m.shape[-1]
    assert width == (2 + n) * n, (m.shape, n)
    rows = int(jnp.size(m) // width)
    block_rows = block_rows or (SMALL_BLOCK if rows <= SMALL_BLOCK else 256)
    num_warps = num_warps or (1 if block_rows <= SMALL_BLOCK else 4)
    m2 = pad_axis(m.reshape(rows, width).astype(jnp.float32), 0, block_rows, 0.0)
    R = m2.shape[0]

    def body(m_ref, scale_ref, base_ref, pre_ref, post_ref, comb_ref):
        r = iota(block_rows, pl.program_id(0) * block_rows)
        col = lambda j: gather(m_ref, r, jnp.int32(j))                                # noqa: E731
        s = [gather(scale_ref, jnp.int32(i)) for i in range(3)]
        b = [gather(base_ref, jnp.int32(j)) for j in range(width)]
        for i in range(n):
            pre_ref[r, jnp.int32(i)] = _sigmoid(col(i) * s[0] + b[i]) + eps
            post_ref[r, jnp.int32(i)] = 2.0 * _sigmoid(col(n + i) * s[1] + b[n + i])
        c = [[col(2 * n + j * n + k) * s[2] + b[2 * n + j * n + k] for k in range(n)] for j in range(n)]
        for j in range(n):                                           # softmax over each row, + eps
            top = c[j][0]
            for k in range(1, n):
                top = jnp.maximum(top, c[j][k])
            e = [jnp.exp(c[j][k] - top) for k in range(n)]
            tot = sum(e[1:], e[0])
            c[j] = [v + eps for v in normalise(e, tot)]

        def cols(c):                                                 # divide each column by its sum + eps
            sums = [sum((c[j][k] for j in range(1, n)), c[0][k]) + eps for k in range(n)]
            by_col = [normalise([c[j][k] for j in range(n)], sums[k]) for k in range(n)]
            return [[by_col[k][j] for k in range(n)] for j in range(n)]

        def rows_(c):
            sums = [sum(c[j][1:], c[j][0]) + eps for j in range(n)]
            return [normalise(c[j], sums[j]) for j in range(n)]

        c = cols(c)
        for _ in range(iters - 1):
            c = cols(rows_(c))
        for j in range(n):
            for k in range(n):
                comb_ref[r, jnp.int32(j * n + k)] = c[j][k]

    f32 = jnp.float32
    check_offsets("mhc_sinkhorn", m2)
    pre, post, comb = pl.pallas_call(
        body,
        out_shape=(jax.ShapeDtypeStruct((R, n), f32), jax.ShapeDtypeStruct((R, n), f32),
                   jax.ShapeDtypeStruct((R, n * n), f32)),
        grid=(R // block_rows,),
        compiler_params=triton_params(num_warps, 1),
        interpret=triton_interpret(interpret),
        name="mhc_sinkhorn",
    )(m2, scale.astype(f32), base.astype(f32))
    return (pre[:rows].reshape(lead + (n,)), post[:rows].reshape(lead + (n,)),
            comb[:rows].reshape(lead + (n, n)))
