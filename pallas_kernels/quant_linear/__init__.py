"""Dense linear over a weight in its stored format (FP8 blocks, packed FP4, bf16): y = x · Wᵀ, no dequantised copy."""

from dsjax.kernels.quant_linear.api import quant_linear

__all__ = ["quant_linear"]
