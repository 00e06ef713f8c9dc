"""Run an op as one compiled program in a test.

Called eagerly, an op's jnp glue compiles each operation on its own: the Mosaic MoE op at 8 tokens is ~200 small
XLA:CPU programs. Under `jax.jit` it is one: the op's two calls in one `test_op_matches_reference` case took 10.6 s
instead of 18.2 s, and test_kernel_moe_gemm_mosaic.py alone 315 s instead of 345 s (2026-12-06, docs/testing.md).
It does not pay everywhere: test_kernel_moe_gemm.py's Triton-interpreted op got no faster (its eager programs are
reused across its tests), so that file keeps the eager op, and so do the cases' random weights.

Every call traces afresh (a new `partial`, so jax's cache keyed on the function never hits): a test that
monkeypatches a module constant or records a kernel's options at trace time sees each call.
"""

import functools

import jax


def one_program(fn, *arrays, **options):
    """fn(*arrays, **options) compiled as one program: arrays traced, options static."""
    return jax.jit(functools.partial(fn, **options))(*arrays)
