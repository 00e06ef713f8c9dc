"""Routed-expert GEMM: tokens x their active experts (SwiGLU with clamp, routing weight before the down projection)."""

from dsjax.kernels.moe_gemm.api import moe_gemm

__all__ = ["moe_gemm"]
