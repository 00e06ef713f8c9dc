"""Run the FP4 MoE op (V4-Flash shapes, FP8 activations) at argv[1] tokens argv[2] times (for ncu)."""
import functools, json, sys
import jax
from dsjax.bench.kernels import expert_stack, moe_routing, moe_shapes
from dsjax.kernels import moe_gemm
n, reps = int(sys.argv[1]), int(sys.argv[2])
cfg = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
E, D, I, k = moe_shapes(False)
keys = jax.random.split(jax.random.key(2), 3)
lins = [expert_stack(keys[0], E, I, D, "fp4"), expert_stack(keys[1], E, I, D, "fp4"), expert_stack(keys[2], E, D, I, "fp4")]
x, w, ids = moe_routing(n, E, D, k)
fn = jax.jit(functools.partial(moe_gemm.moe_gemm, swiglu_limit=10.0, act_quant_sim=True, act_quant_block=128,
                               implementation="pallas", **cfg))
for _ in range(reps):
    out = fn(x, w, ids, *lins)
out.block_until_ready()
print("ran", n, reps, cfg)
