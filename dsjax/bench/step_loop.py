"""Time the real generation loop — `decode_steps` or the speculative `spec_steps`, many steps per dispatch,
the host reading counts back after each dispatch exactly as `generate.stream` does — at a chosen context,
batch, draft length and steps per dispatch, without a prefill: caches start at the context position
(`slices.state_at`). Speculative steps use forced acceptance, so the figures are "simulated"."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from dsjax.bench.slices import state_at
from dsjax.decode import LoopCarry, decode_steps
from dsjax.model import forward_hidden_chunk
from dsjax.sampling import make_sampling
from dsjax.speculative import Forced, SpecCarry, spec_steps


def simulated_pattern(acceptance_length: float, k: int, period: int = 10) -> tuple[int, ...]:
    """Accepted drafts per step whose mean + 1 (the bonus token) is `acceptance_length`, spread evenly."""
    target = min(max(acceptance_length - 1.0, 0.0), k)
    lo = int(np.floor(target))
    n_hi = int(round((target - lo) * period))
    return tuple(min(lo + 1, k) if (i * n_hi) // period != ((i + 1) * n_hi) // period else lo for i in range(period))


def _carry(model, batch: int, ctx: int, k: int, n_tokens: int, max_seq: int, seed: int):
    cfg = model.cfg
    rng = np.random.default_rng(seed)
    last = jnp.asarray(rng.integers(0, cfg.vocab_size, batch), jnp.int32)
    tokens = jnp.zeros((batch, n_tokens), jnp.int32)
    logprob = jnp.zeros((batch, n_tokens), jnp.float32)
    def zeros():  # distinct buffers: the loop donates its carry
        return jnp.zeros((batch,), jnp.int32)

    done = jnp.zeros((batch,), bool)
    if k == 0:
        return LoopCarry(state=state_at(cfg, batch, max_seq, ctx), last=last, tokens=tokens, logprob=logprob,
                         top_ids=jnp.zeros((batch, n_tokens, 0), jnp.int32),
                         top_lp=jnp.zeros((batch, n_tokens, 0), jnp.float32), count=zeros(), done=done,
                         steps=jnp.int32(0))
    if cfg.family == "v4.1":   # DSpark drafts from its rings of main_x (empty here: timing, not acceptance)
        from dsjax.dspark import init_rings
        from dsjax.dspark_loop import DSparkCarry

        return DSparkCarry(state=state_at(cfg, batch, max_seq, ctx), rings=init_rings(cfg, batch),
                           main_x=jnp.zeros((batch, cfg.dim), jnp.dtype(cfg.compute_dtype)), last=last, tokens=tokens,
                           logprob=logprob, count=zeros(), done=done, steps=jnp.int32(0), drafted=zeros(),
                           accepted=zeros(), accepted_at=jnp.zeros((batch, k), jnp.int32), verified=zeros())
    state = state_at(cfg, batch, max_seq, ctx, with_mtp=True)
    with model._on_mesh():
        h = jax.eval_shape(lambda p, s: forward_hidden_chunk(p, cfg, jnp.zeros((batch, 1), jnp.int32), s)[0],
                           model.params, state)
    return SpecCarry(state=state, last=last, pend_h=jnp.zeros((batch, k + 1) + h.shape[2:], h.dtype),
                     pend_tok=jnp.zeros((batch, k + 1), jnp.int32), pend_n=jnp.ones((batch,), jnp.int32),
                     tokens=tokens, logprob=logprob, count=zeros(), done=done, steps=jnp.int32(0),
                     drafted=zeros(), accepted=zeros(), accepted_at=jnp.zeros((batch, k), jnp.int32))


def time_loop(model, *, batch: int = 1, ctx: int = 4096, k: int = 0, acceptance_length: float | None = None,
              steps: int = 64, steps_per_dispatch: int = 32, seed: int = 0, keep_tokens: bool = False) -> dict:
    """ms per step of `steps` loop steps (after one warm-up dispatch that compiles), host share included.

    k = 0: plain decode; k > 0: draft of k (MTP for V4, DSpark's block for V4.1) + verify of k+1 + accept +
    commit, acceptance forced to `acceptance_length` (default: every draft accepted) — simulated."""
    cfg = model.cfg
    al = float(k + 1) if acceptance_length is None else float(acceptance_length)
    per_step = k + 1 if k else 1
    warm = 2 * steps_per_dispatch
    n_tokens = (steps + warm + 1) * per_step
    max_seq = -(-(ctx + n_tokens + per_step + 1) // 128) * 128
    carry = _carry(model, batch, ctx, k, n_tokens, max_seq, seed)
    sp = make_sampling(batch, temperature=0.0, seed=seed)
    stop_ids = jnp.zeros((0,), jnp.int32)
    max_new = jnp.full((batch,), n_tokens, jnp.int32)
    pattern = simulated_pattern(al, k) if k else ()
    forced = Forced(jnp.asarray(pattern, jnp.int32)) if k else None
    if model.mesh is None:  # committed inputs, like the outputs they are replaced by: one compile, not two
        dev = jax.devices()[0]
        carry, sp, stop_ids, max_new, forced = jax.device_put((carry, sp, stop_ids, max_new, forced), dev)

    def dispatch(carry):
        with model._on_mesh():
            if k and cfg.family == "v4.1":
                from dsjax.dspark_loop import dspark_steps

                carry = dspark_steps(model.params, carry, sp, stop_ids, max_new, forced, cfg=cfg, k=k,
                                     max_steps=steps_per_dispatch, max_seq=max_seq)
            elif k:
                carry = spec_steps(model.params, carry, sp, stop_ids, max_new, forced, cfg=cfg, k=k,
                                   max_steps=steps_per_dispatch, max_seq=max_seq)
            else:
                carry = decode_steps(model.params, carry, sp, stop_ids, max_new, cfg=cfg,
                                     max_steps=steps_per_dispatch, K=0, max_seq=max_seq)
        jax.device_get((carry.count, carry.done))  # what the host reads per dispatch in generate.stream
        return carry

    t0 = time.perf_counter()
    carry = dispatch(carry)
    compile_s = time.perf_counter() - t0
    # a second untimed dispatch: on a mesh the first dispatch's outputs come back with the mesh's shardings,
    # which the jit cache keys on, so the second call compiles once more
    t0 = time.perf_counter()
    carry = dispatch(carry)
    second_s = time.perf_counter() - t0
    start_steps, start_count = int(carry.steps), np.asarray(carry.count).copy()
    t0 = time.perf_counter()
    while int(carry.steps) - start_steps < steps and not bool(np.all(np.asarray(carry.done))):
        carry = dispatch(carry)
    wall = time.perf_counter() - t0
    n = int(carry.steps) - start_steps
    made = int(np.sum(np.asarray(carry.count) - start_count))
    out = {"batch": batch, "context": ctx, "k": k, "steps_per_dispatch": steps_per_dispatch, "steps": n,
           "ms_per_step": 1e3 * wall / max(n, 1), "tokens_per_s": made / wall if wall else 0.0,
           "tokens_per_step_per_row": made / max(n, 1) / batch, "first_dispatch_s": compile_s,
           "second_dispatch_s": second_s,
           "kernels": cfg.kernels}
    if keep_tokens:  # the greedy tokens every row made (compare runs of the same weights)
        toks, count = jax.device_get((carry.tokens, carry.count))
        out["tokens"] = [row[:c].tolist() for row, c in zip(np.asarray(toks), np.asarray(count))]
    if k:
        out.update(acceptance="simulated", acceptance_length=al, forced_pattern=list(pattern))
    return out
