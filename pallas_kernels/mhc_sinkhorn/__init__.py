"""mHC mixing split + Sinkhorn projection (one fused op for what was ~60 small kernels a layer)."""

from dsjax.kernels.mhc_sinkhorn.api import mhc_sinkhorn

__all__ = ["mhc_sinkhorn"]
