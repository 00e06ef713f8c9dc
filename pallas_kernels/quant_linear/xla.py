"""The model's own path (`dsjax.layers.linear`): dequantise to the compute dtype, matmul with fp32 accumulation."""

from dsjax import quant
from dsjax.layers.linear import dequantize, matmul


def quant_linear(x, w, *, act_quant_sim: bool, act_quant_block: int):
    if act_quant_sim and w.fmt in ("fp8", "fp4"):
        x = quant.fp8_e4m3_sim(x, act_quant_block)
    return matmul(x, dequantize(w, x.dtype), x.dtype)
