"""Lower a jitted function for CUDA on this CPU box under an abstract H200 (jax-anchors §8.5): the tests' name for
`dsjax.bench.lowered_kernels.lower_for_h200`."""

from dsjax.bench.lowered_kernels import lower_for_h200  # noqa: F401
