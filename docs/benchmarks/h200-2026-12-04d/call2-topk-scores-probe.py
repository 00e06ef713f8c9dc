"""Exploratory: the prefill indexer's pieces at V4.1 shapes, one chunk of 1024 queries."""
import functools, json, sys, time
import jax, jax.numpy as jnp, numpy as np
from dsjax.kernels.indexer_topk.xla import topk_lower_index
from dsjax.layers.indexer import key_block_scores

def t(fn, *a, n=5):
    jax.block_until_ready(fn(*a)); ts = []
    for _ in range(n):
        t0 = time.perf_counter(); jax.block_until_ready(fn(*a)); ts.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(ts))

out = []
Q = 1024
for N in (65536, 131072):
    s = jax.random.normal(jax.random.key(0), (1, Q, N), jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)
    vis = jnp.full((1, Q), N, jnp.int32)
    r = dict(N=N, lax_top_k=t(jax.jit(lambda s: jax.lax.top_k(s, 512)), s))
    want = jax.jit(lambda s: jax.lax.top_k(s, 512)[1])(s)
    for tile in (2048, 4096, 8192, 16384):
        f = jax.jit(functools.partial(topk_lower_index, k=512, tile=tile))
        r[f"two_stage_{tile}"] = t(f, s, vis)
        r[f"same_{tile}"] = float(jnp.mean(f(s, vis)[0] == want))
    q = jax.random.normal(jax.random.key(1), (1, Q, 32, 128), jnp.bfloat16)
    k = jax.random.normal(jax.random.key(2), (1, N, 128), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(3), (1, Q, 32), jnp.bfloat16)
    r["index_scores_xla"] = t(jax.jit(lambda q, k, w: key_block_scores(q, k, w, jnp.bfloat16)), q, k, w)
    r["einsum_only_bf16"] = t(jax.jit(lambda q, k: jnp.einsum("bshd,btd->bsht", q, k)), q, k)
    r["gemm_flat"] = t(jax.jit(lambda q, k: jnp.einsum("bmd,btd->bmt", q.reshape(1, Q * 32, 128), k)), q, k)
    r["tflop"] = 2 * Q * 32 * 128 * N / 1e12
    print(json.dumps(r), flush=True)
