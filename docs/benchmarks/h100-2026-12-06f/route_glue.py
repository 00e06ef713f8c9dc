"""Issue 8 experiment: the op's routing glue, variants side by side. mode 'time': the whole op looped (command buffers
as the bench has them), interleaved rounds; mode 'profile': kernels by name (command buffers off), glue alone and op."""
import contextlib, functools, json, os, sys
mode = sys.argv[1]
if mode == "profile":
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="
sys.path.insert(0, os.path.join(os.environ["ROOT"], ".gpu"))
import jax, numpy as np
from route_v2 import route_slots_v2
from dsjax.bench.kernels import expert_stack, moe_routing, moe_shapes, moe_bytes, time_us_looped
from dsjax.bench.roofline import torch_roofline
from dsjax.bench.profile import kernel_times
from dsjax.kernels import moe_gemm
from dsjax.kernels.moe_gemm import route_slots as rs

VARIANTS = {"xla": {}, "xla-v2": {}, "kernel-4w": dict(mosaic_route_kernel=True, mosaic_route_warps=4),
            "kernel-8w": dict(mosaic_route_kernel=True, mosaic_route_warps=8),
            "kernel-16w": dict(mosaic_route_kernel=True, mosaic_route_warps=16)}
ORIG = rs.route_slots_xla


@contextlib.contextmanager
def variant(name):
    rs.route_slots_xla = route_slots_v2 if name == "xla-v2" else ORIG
    try:
        yield
    finally:
        rs.route_slots_xla = ORIG


SMOKE = os.environ.get("SMOKE") == "1"          # a CPU check of this script: tiny shapes, interpreted, no timing
E, D, I, k = moe_shapes(SMOKE)
ks = jax.random.split(jax.random.key(2), 3)
lins = [expert_stack(ks[0], E, I, D, "fp4"), expert_stack(ks[1], E, I, D, "fp4"), expert_stack(ks[2], E, D, I, "fp4")]
roof = torch_roofline() if mode == "time" and not SMOKE else {}
print(json.dumps(dict(mode=mode, device=str(jax.devices()[0]), **roof)), flush=True)
for n in (1, 2, 4, 8):
    x, w, ids = moe_routing(n, E, D, k)
    args = (x, w, ids, *lins)
    nbytes = moe_bytes(lins, len(np.unique(np.asarray(ids)))) + x.nbytes * 3
    op = {v: jax.jit(functools.partial(moe_gemm.moe_gemm, swiglu_limit=10.0, act_quant_sim=True, act_quant_block=128,
                                       implementation="pallas", fp4_kernel="mosaic", **o,
                                       **(dict(interpret=True) if SMOKE else {}))) for v, o in VARIANTS.items()}
    with variant("xla"):
        want = np.asarray(op["xla"](*args))
    for v in VARIANTS:
        with variant(v):
            got = np.asarray(op[v](*args))
        assert (got.view(np.uint16) == want.view(np.uint16)).all(), (n, v)
    if SMOKE:
        print(n, "equal", flush=True)
        continue
    if mode == "time":
        for rnd in range(3):
            for v in VARIANTS:
                with variant(v):
                    us = time_us_looped(op[v], *args)
                print(json.dumps(dict(tokens=n, variant=v, round=rnd, us=round(us, 2),
                                      of_copy=round(nbytes / us / 1e3 / roof["copy_GBps"], 4))), flush=True)
    else:
        for v in VARIANTS:
            opts = dict(VARIANTS[v])
            warps = opts.pop("mosaic_route_warps", None)
            glue = jax.jit(functools.partial(rs.route_slots if opts else rs.route_slots_xla, n_experts=E, pairs=8,
                                             D=D, I=I, **({} if warps is None else dict(warps=warps))))
            with variant(v):
                if v == "xla-v2":
                    glue = jax.jit(functools.partial(route_slots_v2, n_experts=E, pairs=8, D=D, I=I))
                gt, _ = kernel_times(glue, (w, ids), 50)
                ot, _ = kernel_times(op[v], args, 20)
            print(json.dumps(dict(tokens=n, variant=v, glue_us=round(sum(gt.values()), 2), glue_kernels=len(gt),
                                  glue={a: round(b, 2) for a, b in gt.items()}, op_us=round(sum(ot.values()), 2),
                                  op_kernels=len(ot), op={a: round(b, 2) for a, b in list(ot.items())[:16]})),
                  flush=True)
