"""Test names of stored weight formats -> (fmt, block) for `dsjax.weights.stored_linear`: V4's FP8 uses 128 x 128
scale blocks, V4.1's 32 x 32; FP4 scales every 32 values."""

BLOCKS = {"fp8": ("fp8", 128), "fp8b32": ("fp8", 32), "fp4": ("fp4", 32), "bf16": ("bf16", 128)}
