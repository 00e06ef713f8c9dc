"""The definition in plain jnp: the weight dequantised to fp32 by the kernels' own decoder (`common.dequant_weight`,
not the model's), an fp32 matmul at full precision, one rounding to the compute dtype. Power-of-two scales and
e4m3 / e2m1 codes are exact in fp32, so this is the exact product up to fp32 summation order."""

import jax
import jax.numpy as jnp

from dsjax.kernels.common import dequant_weight
from dsjax.numerics import round_to


def quant_linear(x, w):
    dense = dequant_weight(w.weight, w.scale, w.fmt, w.block).astype(jnp.float32)
    y = jnp.einsum("...i,oi->...o", x.astype(jnp.float32), dense, precision=jax.lax.Precision.HIGHEST)
    return round_to(y, x.dtype)
