"""Exploratory (12-04d call 5): top_k_bf16 vs lax.top_k at a prefill chunk's shapes on the GPU: time, equality."""
import json, time
import jax, jax.numpy as jnp, numpy as np
from dsjax.layers.radix_topk import kth_key, sort_keys, top_k_bf16

def t(fn, *a, n=5):
    jax.block_until_ready(fn(*a)); ts = []
    for _ in range(n):
        t0 = time.perf_counter(); jax.block_until_ready(fn(*a)); ts.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(ts))

rng = np.random.default_rng(0)
v = rng.integers(-40, 40, (64, 4096)).astype(np.float32) / 8
v[:, ::7] = -np.inf; v[:, 1::11] = -0.0; v[:, 2::13] = 0.0
s = jnp.asarray(v)
a, b = jax.lax.top_k(s, 512), jax.jit(lambda s: top_k_bf16(s, 512))(s)
print(json.dumps(dict(ties_and_zeros_equal=bool(jnp.all(a[1] == b[1]) & jnp.all(a[0] == b[0])))), flush=True)
for N in (65536, 131072):
    s = jax.random.normal(jax.random.key(N), (1, 1024, N)).astype(jnp.bfloat16).astype(jnp.float32)
    s = jnp.where(jnp.arange(N) < (N * 3) // 4, s, -jnp.inf)
    f1 = jax.jit(lambda s: jax.lax.top_k(s, 512)); f2 = jax.jit(lambda s: top_k_bf16(s, 512))
    r = dict(N=N, lax_top_k_ms=t(f1, s), top_k_bf16_ms=t(f2, s), equal=bool(jnp.all(f1(s)[1] == f2(s)[1])),
             kth_key_ms=t(jax.jit(lambda s: kth_key(sort_keys(s), 512)), s))
    print(json.dumps(r), flush=True)
