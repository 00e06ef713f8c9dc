"""The device side of serving: one fixed batch of slots over one `DecodeState`; rows join and leave between
dispatches, and no shape ever changes, so the compiles made at warm-up serve every request.

A slot's life: `reset` (its state row back to empty) -> prefill chunks (only rows with prompt left advance;
the rest have `n_valid = 0` and keep their caches bit for bit) -> the first token, sampled from the last
prompt position -> decode dispatches (`dsjax.decode.decode_steps`, the same loop `Model.generate` runs) until
done. The host sees tokens once per dispatch. Sampling keys are per row and folded with the position, so a
request's tokens do not depend on which slot it got or what else is running.

This class is single-threaded: the scheduler thread owns it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsjax.config import ModelConfig
from dsjax.decode import LoopCarry, decode_steps
from dsjax.model import forward_hidden_chunk, head_logits
from dsjax.sampling import SamplingParams, sample, token_logprobs
from dsjax.sharding import gather_vocab
from dsjax.serving.prefix_cache import PrefixCache, put_row, take_row
from dsjax.state import init_state


@functools.partial(jax.jit, static_argnames=("cfg", "max_seq"), donate_argnames=("state",))
def _reset_rows(state, mask, *, cfg: ModelConfig, max_seq: int):
    """The rows of `state` where `mask` is set, back to an empty cache (lengths 0); the others untouched."""
    fresh = init_state(cfg, mask.shape[0], max_seq)

    def pick(old, new):
        return jnp.where(mask.reshape(mask.shape + (1,) * (old.ndim - 1)), new, old)

    return jax.tree.map(pick, state, fresh)


@functools.partial(jax.jit, static_argnames=("cfg", "K"), donate_argnames=("state",))
def _prefill(params, tokens, state, n_valid, sp: SamplingParams, *, cfg: ModelConfig, K: int):
    """One prompt chunk tokens [B, C] for the rows with n_valid > 0, and a first token sampled at each row's last
    valid position (what `generate` samples after the prompt: same position, same key). Only the last position's
    logits are computed — a whole chunk's [B, C, vocab] would dwarf everything else."""
    B, C = tokens.shape
    h, state = forward_hidden_chunk(params, cfg, tokens, state, n_valid)
    last = jnp.clip(n_valid - 1, 0, C - 1)
    logits = head_logits(h[jnp.arange(B), last][:, None], params, cfg, params.hc_head, params.norm)[:, 0]
    logits = gather_vocab(logits, cfg.sharding)
    tok = sample(logits, sp, state.lengths)
    lp, top_ids, top_lp = token_logprobs(logits, tok, K)
    return state, tok, lp, top_ids, top_lp


@dataclasses.dataclass(frozen=True)
class RowSampling:
    """One request's sampling settings (validated by `dsjax.sampling.make_sampling` at the edge)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0


@dataclasses.dataclass
class StepOutput:
    """New tokens of one slot after a prefill chunk or a dispatch. `finished`: "stop" | "length" | None."""

    slot: int
    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]  # per token, (id, logprob) alternatives; empty lists when K = 0
    finished: str | None


class SlotEngine:
    """`slots` rows of up to `max_seq` tokens; `prefill_chunk` prompt tokens per row per prefill step;
    `steps_per_dispatch` decode steps per dispatch. Every step also returns the `max_top_logprobs` most likely
    alternatives (one compiled program for every request; a row keeps the first `top_logprobs` of them)."""

    def __init__(self, model, *, slots: int, prefill_chunk: int = 64, steps_per_dispatch: int = 8,
                 max_top_logprobs: int = 20, stop_token_ids: tuple[int, ...] | None = None,
                 prefix_cache_entries: int = 0):
        self.model, self.cfg, self.params = model, model.cfg, model.params
        self.slots, self.max_seq = slots, model.max_seq_len
        self.chunk, self.steps, self.max_top = prefill_chunk, steps_per_dispatch, max_top_logprobs
        stops = (self.cfg.eos_token_id,) if stop_token_ids is None else stop_token_ids
        self.stop_ids = jnp.asarray(sorted(set(stops)), jnp.int32)
        self.stop_set = frozenset(int(t) for t in stops)
        with model._on_mesh():
            self.state = init_state(self.cfg, slots, self.max_seq)
            self.last = jnp.zeros((slots,), jnp.int32)
        # host mirrors of per-row settings; device copies are rebuilt when a row joins
        self._temperature = np.zeros(slots, np.float32)
        self._top_p = np.ones(slots, np.float32)
        self._top_k = np.zeros(slots, np.int32)
        self._min_p = np.zeros(slots, np.float32)
        self._keys = np.zeros((slots, 2), np.uint32)
        self._sp: SamplingParams | None = None
        self.prompt: list[np.ndarray | None] = [None] * slots  # prompt tokens still to prefill
        self.decoding = np.zeros(slots, bool)
        self.remaining = np.zeros(slots, np.int32)                # tokens the row may still generate
        self.wants_top = np.zeros(slots, np.int32)                # top-logprob alternatives per row
        self._pending_reset = np.zeros(slots, bool)
        self._pending_insert: dict[int, object] = {}                # slot -> cached row state to start from
        self._full_prompt: list[np.ndarray | None] = [None] * slots
        self.cache = PrefixCache(prefix_cache_entries)

    # ---- rows joining and leaving ----

    def free_slots(self) -> list[int]:
        return [b for b in range(self.slots) if self.prompt[b] is None and not self.decoding[b]]

    def join(self, slot: int, prompt: list[int], max_new_tokens: int, sampling: RowSampling,
             top_logprobs: int = 0) -> int:
        """Put a request into a free slot; its prompt is prefilled by the next `prefill_step` calls.
        Returns how many prompt tokens come from the prefix cache (not prefilled again)."""
        assert self.prompt[slot] is None and not self.decoding[slot], f"slot {slot} is busy"
        full = np.asarray(prompt, np.int32)
        cached, row = self.cache.lookup(full)
        self._full_prompt[slot] = full
        self.prompt[slot] = full[cached:]
        self.remaining[slot] = max_new_tokens
        self.wants_top[slot] = top_logprobs
        self._temperature[slot], self._top_p[slot] = sampling.temperature, sampling.top_p
        self._top_k[slot], self._min_p[slot] = sampling.top_k, sampling.min_p
        self._keys[slot] = np.asarray(jax.random.key_data(jax.random.PRNGKey(sampling.seed % 2**32)))
        self._sp = None
        if row is None:
            self._pending_reset[slot] = True
            self._pending_insert.pop(slot, None)
        else:
            self._pending_reset[slot] = False
            self._pending_insert[slot] = row
        return cached

    def leave(self, slot: int) -> None:
        """Stop a row now (abort, stop string): it no longer advances; its cache is reset when the slot is reused."""
        self.prompt[slot] = None
        self.decoding[slot] = False

    def reset_all(self) -> None:
        """Forget every row and start from empty caches (after a failed step, whose donated state is gone)."""
        with self.model._on_mesh():
            self.state = init_state(self.cfg, self.slots, self.max_seq)
            self.last = jnp.zeros((self.slots,), jnp.int32)
        self.prompt = [None] * self.slots
        self.decoding[:] = False
        self._pending_reset[:] = False
        self._pending_insert.clear()
        self.cache.clear()

    def busy(self) -> bool:
        return bool(self.decoding.any()) or any(p is not None for p in self.prompt)

    def _sampling(self) -> SamplingParams:
        if self._sp is None:
            self._sp = SamplingParams(jnp.asarray(self._temperature), jnp.asarray(self._top_k),
                                      jnp.asarray(self._top_p), jnp.asarray(self._min_p), jnp.asarray(self._keys))
        return self._sp

    # ---- device steps ----

    def prefill_step(self) -> list[StepOutput]:
        """One chunk of every row with prompt left; rows whose prompt ends here get their first token."""
        rows = [b for b in range(self.slots) if self.prompt[b] is not None]
        if not rows:
            return []
        with self.model._on_mesh():
            if self._pending_reset.any():
                self.state = _reset_rows(self.state, jnp.asarray(self._pending_reset), cfg=self.cfg,
                                         max_seq=self.max_seq)
                self._pending_reset[:] = False
            for b, row in self._pending_insert.items():
                self.state = put_row(self.state, row, jnp.int32(b))
            self._pending_insert.clear()
            C = self.chunk
            tokens = np.zeros((self.slots, C), np.int32)
            n_valid = np.zeros(self.slots, np.int32)
            for b in rows:
                part = self.prompt[b][:C]
                tokens[b, :len(part)], n_valid[b] = part, len(part)
            K = self.max_top
            self.state, tok, lp, top_ids, top_lp = _prefill(self.params, jnp.asarray(tokens), self.state,
                                                             jnp.asarray(n_valid), self._sampling(), cfg=self.cfg, K=K)
            ended = [b for b in rows if len(self.prompt[b]) <= C]
            for b in rows:
                self.prompt[b] = self.prompt[b][C:] if b not in ended else None
            if not ended:
                return []
            if self.cache.capacity:
                for b in ended:
                    self.cache.store(self._full_prompt[b], take_row(self.state, jnp.int32(b)))
            mask = np.zeros(self.slots, bool)
            mask[ended] = True
            self.last = jnp.where(jnp.asarray(mask), tok, self.last)
            tok, lp, top_ids, top_lp, lengths = jax.device_get((tok, lp, top_ids, top_lp, self.state.lengths))
        out = []
        for b in ended:
            t = int(tok[b])
            self.remaining[b] -= 1
            finished = ("stop" if t in self.stop_set else
                        "length" if self.remaining[b] <= 0 or lengths[b] + 1 >= self.max_seq else None)
            self.decoding[b] = finished is None
            top = [list(zip(top_ids[b].tolist(), top_lp[b].tolist()))[:self.wants_top[b]]] if K else [[]]
            out.append(StepOutput(b, [t], [float(lp[b])], top, finished))
        return out

    def decode_step(self) -> list[StepOutput]:
        """One dispatch of up to `steps_per_dispatch` decode steps for every decoding row."""
        rows = np.flatnonzero(self.decoding)
        if not rows.size:
            return []
        B, N, K = self.slots, self.steps, self.max_top
        with self.model._on_mesh():
            carry = LoopCarry(
                state=self.state, last=self.last, tokens=jnp.zeros((B, N), jnp.int32),
                logprob=jnp.zeros((B, N), jnp.float32), top_ids=jnp.zeros((B, N, K), jnp.int32),
                top_lp=jnp.zeros((B, N, K), jnp.float32), count=jnp.zeros((B,), jnp.int32),
                done=jnp.asarray(~self.decoding), steps=jnp.int32(0))
            max_new = jnp.asarray(np.maximum(self.remaining, 1))
            carry = decode_steps(self.params, carry, self._sampling(), self.stop_ids, max_new, cfg=self.cfg,
                                 max_steps=N, K=K, max_seq=self.max_seq)
            self.state, self.last = carry.state, carry.last
            count, done, toks, lp, top_ids, top_lp = jax.device_get(
                (carry.count, carry.done, carry.tokens, carry.logprob, carry.top_ids, carry.top_lp))
        out = []
        for b in rows:
            n = int(count[b])
            new = toks[b, :n].tolist()
            self.remaining[b] -= n
            finished = None
            if done[b]:
                finished = "stop" if new and new[-1] in self.stop_set else "length"
                self.decoding[b] = False
            top = ([list(zip(top_ids[b, i].tolist(), top_lp[b, i].tolist()))[:self.wants_top[b]] for i in range(n)]
                   if K else [[] for _ in range(n)])
            out.append(StepOutput(int(b), new, lp[b, :n].tolist(), top, finished))
        return out

    def warm_up(self) -> None:
        """Compile every program serving runs (row reset, prefill chunk, decode dispatch) before reporting ready."""
        bos = self.cfg.bos_token_id
        for prompt in ([bos], [bos, bos]) if self.cache.capacity else ([bos],):  # the second one hits the cache
            self.join(0, prompt, 2, RowSampling())
            self.prefill_step()
            self.decoding[0], self.remaining[0] = True, 1  # even if the first token was a stop id
            self.decode_step()
            self.leave(0)
        self.cache.clear()
