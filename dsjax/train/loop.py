"""The training loop: optax AdamW with linear warmup + cosine decay, one jit'd step, resumable Orbax state.

The learning rate is an argument of the step (AdamW with the rate factored out: clip, Adam, decoupled decay, then
× −lr), computed on the host from (step, total steps) — so a run given a wall-clock budget can fix its total steps
after timing its first steps, without recompiling, and the cosine still ends where the run ends.

Batches are a pure function of (seed, step) — `numpy.random.default_rng([seed, step])` cuts the windows — so a
run resumed from its latest checkpoint sees exactly the batches an uninterrupted run would. The Orbax state is
{trainable fp32 params, optimizer state, step}; integer leaves (tid2eid, the vocabulary map) are rebuilt from the
config and the saved vocabulary, never optimised. Weight decay applies to matrices only (ndim ≥ 2), not to norms,
biases, sinks or hyper-connection bases. Held-out loss is measured every `eval_every` steps on a fixed set of
windows; the history goes to history.json and loss_curve.png (matplotlib, Agg: no display needed).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dsjax.config import ModelConfig
from dsjax.train import corpus, loss as L


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    steps: int = 6000
    batch_size: int = 32
    seq_len: int = 512
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mtp_weight: float = 0.3
    eval_every: int = 250
    eval_windows: int = 64
    ckpt_every: int = 500
    keep_checkpoints: int = 2
    seed: int = 0
    time_budget_s: float | None = None  # wall seconds for train() (compile included); fixes the total steps


PROBE = (5, 35)  # steps after the start timed to fix a time-budgeted run's total (the first ones compile)


def learning_rate(step: int, s: TrainSettings, total: int) -> float:
    """Linear warmup from 0 to s.lr, then cosine to s.lr·min_lr_ratio at step `total` (optax's
    warmup_cosine_decay_schedule, evaluated on the host)."""
    warm = max(1, s.warmup_steps)
    if step < warm:
        return s.lr * step / warm
    span = max(1, total - warm)
    end = s.lr * s.min_lr_ratio
    return end + (s.lr - end) * 0.5 * (1 + np.cos(np.pi * min(step - warm, span) / span))


def optimizer(s: TrainSettings):
    """AdamW without its learning rate (the step multiplies the update by −lr)."""
    decay_mask = lambda tree: jax.tree.map(lambda a: a.ndim >= 2, tree)
    return optax.chain(optax.clip_by_global_norm(s.grad_clip), optax.scale_by_adam(b1=0.9, b2=0.95, eps=1e-8),
                       optax.add_decayed_weights(s.weight_decay, mask=decay_mask))


@functools.lru_cache(maxsize=8)
def make_step(cfg: ModelConfig, s: TrainSettings):
    """jit'd (train, opt_state, frozen, batch, lr) -> (train, opt_state, metrics); train/opt_state donated.
    Cached per (config, settings), so a resumed run in the same process reuses the compiled step."""
    opt = optimizer(s)

    def step(train, opt_state, frozen, batch, lr):
        (total, (main, mtp)), grads = jax.value_and_grad(L.total_loss, has_aux=True)(train, frozen, cfg, batch,
                                                                                    s.mtp_weight)
        updates, opt_state = opt.update(grads, opt_state, train)
        updates = jax.tree.map(lambda u: (-lr * u).astype(u.dtype), updates)
        train = optax.apply_updates(train, updates)
        return train, opt_state, {"loss": total, "main": main, "mtp": mtp, "grad_norm": optax.tree.norm(grads)}

    return jax.jit(step, donate_argnums=(0, 1))


@functools.lru_cache(maxsize=8)
def make_eval(cfg: ModelConfig):
    def evaluate(train, frozen, batch):
        return L.losses(L.merge(train, frozen), cfg, batch)

    return jax.jit(evaluate)


def held_out_loss(evaluate, train, frozen, windows: np.ndarray, batch_size: int) -> tuple[float, float]:
    """Mean (main, MTP) CE over the fixed held-out windows, in batches of the training batch size."""
    mains, mtps = [], []
    batch_size = min(batch_size, len(windows))
    for i in range(0, len(windows) - batch_size + 1, batch_size):
        m, t = evaluate(train, frozen, jnp.asarray(windows[i:i + batch_size]))
        mains.append(float(m))
        mtps.append(float(t))
    return float(np.mean(mains)), float(np.mean(mtps))


def initial_state(params, s: TrainSettings):
    """(trainable, frozen, optimizer state) of a fresh run, committed to the first device as Orbax restores
    them — so a resumed run hits the same compiled step (committed and uncommitted inputs compile apart)."""
    train, frozen = L.split(params)
    return jax.device_put((train, frozen, optimizer(s).init(train)), jax.devices()[0])


def batch_at(stream: np.ndarray, s: TrainSettings, step: int) -> np.ndarray:
    return corpus.windows(stream, s.batch_size, s.seq_len, np.random.default_rng([s.seed, step]))


def checkpoint_manager(path: str, s: TrainSettings):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(os.path.abspath(path),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=s.keep_checkpoints, create=True))


def save_state(mgr, step: int, train, opt_state) -> None:
    import orbax.checkpoint as ocp

    mgr.save(step, args=ocp.args.StandardSave({"train": train, "opt_state": opt_state, "step": jnp.asarray(step)}))
    mgr.wait_until_finished()


def restore_state(mgr, train, opt_state):
    """(step, train, opt_state) from the latest checkpoint, or (0, the given ones) when there is none."""
    import orbax.checkpoint as ocp

    step = mgr.latest_step()
    if step is None:
        return 0, train, opt_state
    target = {"train": train, "opt_state": opt_state, "step": jnp.asarray(0)}
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype) if hasattr(a, "shape") else a, target)
    got = mgr.restore(step, args=ocp.args.StandardRestore(abstract))
    return int(got["step"]), got["train"], got["opt_state"]


def plot_history(history: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    tr = history["train"]
    if tr:
        steps = [r["step"] for r in tr]
        ax.plot(steps, [r["main"] for r in tr], lw=0.8, alpha=0.7, label="train next-token")
        ax.plot(steps, [r["mtp"] for r in tr], lw=0.8, alpha=0.7, label="train MTP (t+2)")
    ev = history["eval"]
    if ev:
        ax.plot([r["step"] for r in ev], [r["main"] for r in ev], "o-", label="held-out next-token")
        ax.plot([r["step"] for r in ev], [r["mtp"] for r in ev], "s-", label="held-out MTP (t+2)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(history.get("title", "dsjax train"))
    ax.grid(alpha=0.3)
    if tr or ev:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def train(cfg: ModelConfig, params, train_stream: np.ndarray, held_stream: np.ndarray, s: TrainSettings, out: str,
          *, progress: bool = True, log_every: int = 10, until: int | None = None):
    """Train `params` (an init of `train_config(cfg)`), resuming from `out`/checkpoints when it holds any.
    `until`: stop (with a checkpoint) after that step of the schedule; rerun to continue. With `s.time_budget_s`
    the schedule's length is fixed after timing steps PROBE (at most `s.steps`) and kept in OUT/schedule.json.
    Returns (trainable params, frozen params, history); history["steps"] is the schedule's length."""
    from tqdm.auto import tqdm

    os.makedirs(out, exist_ok=True)
    train, frozen, opt_state = initial_state(params, s)
    mgr = checkpoint_manager(os.path.join(out, "checkpoints"), s)
    start, train, opt_state = restore_state(mgr, train, opt_state)
    train, opt_state = jax.device_put((train, opt_state), jax.devices()[0])
    hist_path = os.path.join(out, "history.json")
    history = {"train": [], "eval": [], "title": f"{cfg.name}: {s.batch_size}x{s.seq_len} tokens/step"}
    if start and os.path.exists(hist_path):
        with open(hist_path) as f:
            history = json.load(f)
        history["train"] = [r for r in history["train"] if r["step"] <= start]
        history["eval"] = [r for r in history["eval"] if r["step"] <= start]
    step_fn, evaluate = make_step(cfg, s), make_eval(cfg)
    eval_set = corpus.eval_windows(held_stream, s.eval_windows, s.seq_len)

    def write_history():
        with open(hist_path, "w") as f:
            json.dump(history, f)
        plot_history(history, os.path.join(out, "loss_curve.png"))

    sched_path = os.path.join(out, "schedule.json")
    total, fixed = s.steps, not s.time_budget_s
    if os.path.exists(sched_path):  # a resumed run keeps the total its first run fixed
        with open(sched_path) as f:
            total, fixed = int(json.load(f)["steps"]), True
    history["steps"] = total
    bar = tqdm(total=total, initial=start, desc="train", unit="step", disable=not progress, dynamic_ncols=True)
    t_begin, t_probe, last = time.perf_counter(), None, None
    t0 = t_begin - (history["train"][-1]["time_s"] if history["train"] else 0.0)
    step = start
    while step < (total if until is None else min(until, total)):
        lr = jnp.float32(learning_rate(step, s, total))
        train, opt_state, m = step_fn(train, opt_state, frozen, jnp.asarray(batch_at(train_stream, s, step)), lr)
        step = done = step + 1
        if not fixed and done in (start + PROBE[0], start + PROBE[1]):
            jax.block_until_ready(m)
            now = time.perf_counter()
            if done == start + PROBE[0]:
                t_probe = now
            else:  # 8% kept back for evaluations and checkpoints
                rate = (PROBE[1] - PROBE[0]) / (now - t_probe)
                total = max(done, min(s.steps, done + int(0.92 * rate * (s.time_budget_s - (now - t_begin)))))
                fixed = True
                history["steps"] = total
                with open(sched_path, "w") as f:
                    json.dump({"steps": total, "steps_per_s": rate, "time_budget_s": s.time_budget_s}, f)
                bar.total = total
                bar.write(f"{rate:.2f} steps/s: {total} steps fit the {s.time_budget_s:.0f} s budget")
        stop = total if until is None else min(until, total)
        if done % log_every == 0 or done == stop:
            last = {k: float(v) for k, v in m.items()}
            history["train"].append({"step": done, **last, "lr": float(lr), "time_s": time.perf_counter() - t0})
            bar.set_postfix(loss=f"{last['main']:.3f}", mtp=f"{last['mtp']:.3f}")
        if s.eval_every and (done % s.eval_every == 0 or done == stop):
            main, mtp = held_out_loss(evaluate, train, frozen, eval_set, s.batch_size)
            history["eval"].append({"step": done, "main": main, "mtp": mtp})
            bar.write(f"step {done}: held-out loss {main:.4f} (MTP {mtp:.4f})")
        if done % s.ckpt_every == 0 or done == stop:
            save_state(mgr, done, train, opt_state)
            write_history()
        bar.update(1)
    bar.close()
    mgr.close()
    return train, frozen, history
