"""The device side of serving: one fixed batch of slots over one `DecodeState`; rows join and leave between
dispatches, and no shape ever changes, so the compiles made at warm-up serve every request.

A slot's life: `reset` (its state row back to empty) -> prefill chunks (only rows with prompt left advance;
the rest have `n_valid = 0` and keep their caches bit for bit) -> the first token, sampled from the last
prompt position -> decode dispatches (`dsjax.decode.decode_steps`, the same loop `Model.generate` runs; or
`dsjax.speculative.spec_steps` with MTP drafts) until done. The host sees tokens once per dispatch. Sampling keys
are per row and folded with the position, so a request's tokens do not depend on which slot it got or what else
is running. Presence/frequency penalties and logit_bias are part of every plain prefill and decode program
(`dsjax.sampling.Penalties`: per-row values, a [slots, vocab] bias and output-token counts carried on the
device; zeros for rows that do not ask) — one program for every mix of requests, at the cost of a [slots, vocab]
add per step.

This class is single-threaded: the scheduler thread owns it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dsjax.decode import LoopCarry, decode_steps
from dsjax.errors import ConfigError
from dsjax.generate import stop_id_row
from dsjax.sampling import Penalties, SamplingParams
from dsjax.serving.engine_steps import join_rows, prefill, replay_end
from dsjax.serving.prefix_cache import PrefixCache, put_row, take_row
from dsjax.speculative import SpecCarry, spec_steps
from dsjax.state import init_state
from dsjax.v41_replay import empty_keep, encode_chunk41


@dataclasses.dataclass(frozen=True)
class RowSampling:
    """One request's sampling settings (validated by `dsjax.sampling.make_sampling` at the edge)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs

    @property
    def penalised(self) -> bool:
        """Whether the request asks for penalties or a bias (refused by a speculative server)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)


@dataclasses.dataclass
class StepOutput:
    """New tokens of one slot after a prefill chunk or a dispatch. `finished`: "stop" | "length" | None."""

    slot: int
    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]  # per token, (id, logprob) alternatives; empty lists when K = 0
    finished: str | None
    row_steps: int = 0  # speculative: draft-verify steps this row took in the dispatch
    drafted: int = 0
    accepted: int = 0


class SlotEngine:
    """`slots` rows of up to `max_seq` tokens; `prefill_chunk` prompt tokens per row per prefill step;
    `steps_per_dispatch` decode steps per dispatch. Every step also returns the `max_top_logprobs` most likely
    alternatives (one compiled program for every request; a row keeps the first `top_logprobs` of them).
    `num_speculative_tokens` > 0 decodes with the MTP draft-verify loop (`dsjax.speculative.spec_steps`): each
    row carries its pending target streams across dispatches; only the chosen token's logprob is reported.
    `prefill_schedule="replay"` (V4.1): each chunk runs the encoder layers and the ratio-1 source
    only, and a row's decoder layers run once, over its last window of prompt positions, when its prompt ends
    (`dsjax.v41_replay`; a row continuing a cached prefix replays only its new positions)."""

    def __init__(self, model, *, slots: int, prefill_chunk: int = 64, steps_per_dispatch: int = 8,
                 max_top_logprobs: int = 20, stop_token_ids: tuple[int, ...] | None = None,
                 prefix_cache_entries: int = 0, num_speculative_tokens: int = 0, prefill_schedule: str = "exact"):
        from dsjax.v41_replay import SCHEDULES, decoder_start

        self.model, self.cfg, self.params = model, model.cfg, model.params
        self.slots, self.max_seq = slots, model.max_seq_len
        self.chunk, self.steps, self.k = prefill_chunk, steps_per_dispatch, num_speculative_tokens
        if prefill_schedule not in SCHEDULES:
            raise ConfigError(f"prefill schedule {prefill_schedule!r}: choose one of {', '.join(SCHEDULES)}")
        self.replay = prefill_schedule == "replay"
        if self.replay:
            decoder_start(self.cfg)  # a V4.1 model with a ratio-1 KV source, or a ConfigError
            if self.k:
                raise ConfigError("the replay prefill schedule serves without speculative decoding")
        self._replay_first = np.zeros(slots, np.int32)   # replay: each row's first replayed position
        self._window_from = np.zeros(slots, np.int32)    # ... and the first with decoder window rows
        self.max_top = 0 if self.k else max_top_logprobs
        stops = (self.cfg.eos_token_id,) if stop_token_ids is None else stop_token_ids
        self.stop_ids = stop_id_row(stops)
        self.stop_set = frozenset(int(t) for t in stops)
        self._fresh_device_state()
        # host mirrors of per-row settings; device copies are rebuilt when a row joins
        self._temperature = np.zeros(slots, np.float32)
        self._top_p = np.ones(slots, np.float32)
        self._top_k = np.zeros(slots, np.int32)
        self._min_p = np.zeros(slots, np.float32)
        self._keys = np.zeros((slots, 2), np.uint32)
        self._presence = np.zeros(slots, np.float32)
        self._frequency = np.zeros(slots, np.float32)
        self._bias = np.zeros((slots, self.cfg.vocab_size), np.float32)
        self._sp: SamplingParams | None = None
        self._pen: tuple | None = None
        self.prompt: list[np.ndarray | None] = [None] * slots  # prompt tokens still to prefill
        self.decoding = np.zeros(slots, bool)
        self.remaining = np.zeros(slots, np.int32)                # tokens the row may still generate
        self.wants_top = np.zeros(slots, np.int32)                # top-logprob alternatives per row
        self._pending_reset = np.zeros(slots, bool)
        self._pending_clear = np.zeros(slots, bool)
        self._pending_insert: dict[int, object] = {}                # slot -> cached row state to start from
        self._full_prompt: list[np.ndarray | None] = [None] * slots
        self._vision: list[tuple | None] = [None] * slots  # (span rows, index over the full prompt) of image rows
        self.cache = PrefixCache(prefix_cache_entries)

    def _fresh_device_state(self) -> None:
        B = self.slots
        with self.model._on_mesh():
            self.state = init_state(self.cfg, B, self.max_seq, with_mtp=self.k > 0)
            self.last = jnp.zeros((B,), jnp.int32)
            self.counts = jnp.zeros((B, self.cfg.vocab_size), jnp.int32)
            self.keep = empty_keep(self.cfg, B) if self.replay else None  # replay: the stream at kept positions
        self.pend_h = self.pend_tok = self.pend_n = None  # speculative: set by the first prefill

    # ---- rows joining and leaving ----

    def free_slots(self) -> list[int]:
        return [b for b in range(self.slots) if self.prompt[b] is None and not self.decoding[b]]

    def join(self, slot: int, prompt: list[int], max_new_tokens: int, sampling: RowSampling,
             top_logprobs: int = 0, start=None, images=None) -> int:
        """Put a request into a free slot; its prompt is prefilled by the next `prefill_step` calls.
        `start`: a state row holding the KV of the prompt's first `start.tokens` tokens (a KV handoff), used when
        longer than the prefix cache's match. `images`: the prompt's images (a dsjax.vision PreparedPrompt whose
        ids are `prompt`); their spans are encoded here and the row never shares KV (the spans' token ids do not
        identify the image). Returns how many prompt tokens are not prefilled again."""
        assert self.prompt[slot] is None and not self.decoding[slot], f"slot {slot} is busy"
        full = np.asarray(prompt, np.int32)
        self._vision[slot] = None
        if images is not None and images.images:
            from dsjax.vision.inputs import encode_spans

            with self.model._on_mesh():
                self._vision[slot] = encode_spans(self.params, self.cfg, images)
            cached, row, start = 0, None, None
        else:
            cached, row = self.cache.lookup(full)
        if start is not None and cached < start.tokens < len(full):
            cached, row = start.tokens, start.row
        self._full_prompt[slot] = full
        self.prompt[slot] = full[cached:]
        if self.replay:  # replay the last window, less what a cached state's decoder layers already hold
            first = max(len(full) - self.cfg.window_size, cached)
            self._replay_first[slot] = first
            self._window_from[slot] = first if first > cached else 0
        self.remaining[slot] = max_new_tokens
        self.wants_top[slot] = top_logprobs
        self._temperature[slot], self._top_p[slot] = sampling.temperature, sampling.top_p
        self._top_k[slot], self._min_p[slot] = sampling.top_k, sampling.min_p
        self._keys[slot] = np.asarray(jax.random.key_data(jax.random.PRNGKey(sampling.seed % 2**32)))
        self._presence[slot], self._frequency[slot] = sampling.presence_penalty, sampling.frequency_penalty
        self._bias[slot] = 0.0
        for t, v in sampling.logit_bias:
            self._bias[slot, t] = v
        self._pending_clear[slot] = True
        self._sp = self._pen = None
        if row is None:
            self._pending_reset[slot] = True
            self._pending_insert.pop(slot, None)
        else:
            self._pending_reset[slot] = False
            self._pending_insert[slot] = row
        return cached

    def snapshot(self, slot: int):
        """A copy of the slot's state row on the device (the KV of the tokens it holds), for the host KV store."""
        with self.model._on_mesh():
            return take_row(self.state, jnp.int32(slot))

    def leave(self, slot: int) -> None:
        """Stop a row now (abort, stop string): it no longer advances; its cache is reset when the slot is reused."""
        self.prompt[slot] = None
        self.decoding[slot] = False

    def reset_all(self) -> None:
        """Forget every row and start from empty caches (after a failed step, whose donated state is gone)."""
        self._fresh_device_state()
        self.prompt = [None] * self.slots
        self.decoding[:] = False
        self._pending_reset[:] = False
        self._pending_clear[:] = False
        self._pending_insert.clear()
        self.cache.clear()

    def busy(self) -> bool:
        return bool(self.decoding.any()) or any(p is not None for p in self.prompt)

    def _sampling(self) -> SamplingParams:
        if self._sp is None:
            self._sp = SamplingParams(jnp.asarray(self._temperature), jnp.asarray(self._top_k),
                                      jnp.asarray(self._top_p), jnp.asarray(self._min_p), jnp.asarray(self._keys))
        return self._sp

    def _penalties(self) -> Penalties | None:
        """Every row's penalties and output counts (None with speculative decoding, which does not apply them)."""
        if self.k:
            return None
        if self._pen is None:
            self._pen = (jnp.asarray(self._presence), jnp.asarray(self._frequency), jnp.asarray(self._bias))
        return Penalties(*self._pen, counts=self.counts)

    # ---- device steps ----

    def _apply_joins(self) -> None:
        if self._pending_clear.any():
            self.state, self.counts = join_rows(self.state, self.counts, jnp.asarray(self._pending_reset),
                                                jnp.asarray(self._pending_clear), cfg=self.cfg, max_seq=self.max_seq,
                                                with_mtp=self.k > 0)
            self._pending_reset[:] = self._pending_clear[:] = False
        for b, row in self._pending_insert.items():
            self.state = put_row(self.state, row, jnp.int32(b))
        self._pending_insert.clear()

    def prefill_step(self) -> list[StepOutput]:
        """One chunk of every row with prompt left; rows whose prompt ends here get their first token."""
        rows = [b for b in range(self.slots) if self.prompt[b] is not None]
        if not rows:
            return []
        C, K = self.chunk, self.max_top
        tokens, nxt = np.zeros((self.slots, C), np.int32), np.zeros((self.slots, C), np.int32)
        n_valid, n_mtp = np.zeros(self.slots, np.int32), np.zeros(self.slots, np.int32)
        for b in rows:
            part, after = self.prompt[b][:C], self.prompt[b][1:C + 1]
            tokens[b, :len(part)], n_valid[b] = part, len(part)
            nxt[b, :len(after)], n_mtp[b] = after, len(after)  # the MTP consumes positions whose next token is known
        ended = [b for b in rows if len(self.prompt[b]) <= C]
        ends = np.zeros(self.slots, bool)
        ends[ended] = True
        with self.model._on_mesh():
            self._apply_joins()
            image = self._chunk_images(rows, C)
            if self.replay:
                self.state, self.keep = encode_chunk41(self.params, jnp.asarray(tokens), self.state,
                                                       jnp.asarray(n_valid), self.keep,
                                                       jnp.asarray(self._replay_first), image, cfg=self.cfg)
                last_h = None
                if ended:
                    self.state, tok, lp, top_ids, top_lp, pen = replay_end(
                        self.params, self.state, self.keep, jnp.asarray(self._replay_first),
                        jnp.asarray(self._window_from), jnp.asarray(ends), self._sampling(), self._penalties(),
                        cfg=self.cfg, K=K)
                else:
                    pen = None
            else:
                self.state, tok, lp, top_ids, top_lp, last_h, pen = prefill(
                    self.params, jnp.asarray(tokens), jnp.asarray(nxt), self.state, jnp.asarray(n_valid),
                    jnp.asarray(n_mtp), jnp.asarray(ends), self._sampling(), self._penalties(), image, cfg=self.cfg,
                    K=K, mtp=self.k > 0)
            if pen is not None:
                self.counts = pen.counts
            for b in rows:
                self.prompt[b] = self.prompt[b][C:] if b not in ended else None
            if not ended:
                return []
            if self.cache.capacity:
                for b in ended:
                    if self._vision[b] is None:
                        self.cache.store(self._full_prompt[b], take_row(self.state, jnp.int32(b)))
            mask = jnp.asarray(ends)
            self.last = jnp.where(mask, tok, self.last)
            if self.k:
                self._start_pending(mask, last_h, tok)
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

    def _chunk_images(self, rows, C: int):
        """The model's `image` argument for this prefill chunk: (span rows, index [slots, C]), or None when no row's
        chunk holds an image position."""
        parts, where = [], []
        for b in rows:
            if self._vision[b] is None:
                continue
            done = len(self._full_prompt[b]) - len(self.prompt[b])
            if (self._vision[b][1][done:done + C] >= 0).any():
                parts.append(self._vision[b])
                where.append((b, done))
        if not parts:
            return None
        from dsjax.vision.inputs import merge

        span_rows, index = merge(parts)
        chunk = np.full((self.slots, C), -1, np.int32)
        for (b, done), idx in zip(where, index):
            part = idx[done:done + C]
            chunk[b, :len(part)] = part
        return span_rows, jnp.asarray(chunk)

    def _start_pending(self, mask, last_h, tok) -> None:
        """Speculative rows start with one pending position: the prompt's last (its streams, the first token)."""
        K1 = self.k + 1
        if self.pend_h is None:
            self.pend_h = jnp.zeros((self.slots, K1) + last_h.shape[1:], last_h.dtype)
            self.pend_tok = jnp.zeros((self.slots, K1), jnp.int32)
            self.pend_n = jnp.ones((self.slots,), jnp.int32)
        self.pend_h = jnp.where(mask[:, None, None, None], self.pend_h.at[:, 0].set(last_h), self.pend_h)
        self.pend_tok = jnp.where(mask[:, None], self.pend_tok.at[:, 0].set(tok), self.pend_tok)
        self.pend_n = jnp.where(mask, 1, self.pend_n)

    def decode_step(self) -> list[StepOutput]:
        """One dispatch of up to `steps_per_dispatch` decode (or draft-verify) steps for every decoding row."""
        rows = np.flatnonzero(self.decoding)
        if not rows.size:
            return []
        with self.model._on_mesh():
            if self.k:
                got = self._spec_dispatch()
            else:
                got = self._plain_dispatch()
        count, done, toks, lp, top_ids, top_lp, drafted, accepted = got
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
                   if self.max_top else [[] for _ in range(n)])
            d, a = int(drafted[b]), int(accepted[b])
            out.append(StepOutput(int(b), new, lp[b, :n].tolist(), top, finished,
                                  row_steps=d // self.k if self.k else 0, drafted=d, accepted=a))
        return out

    def _plain_dispatch(self):
        B, N, K = self.slots, self.steps, self.max_top
        carry = LoopCarry(
            state=self.state, last=self.last, tokens=jnp.zeros((B, N), jnp.int32),
            logprob=jnp.zeros((B, N), jnp.float32), top_ids=jnp.zeros((B, N, K), jnp.int32),
            top_lp=jnp.zeros((B, N, K), jnp.float32), count=jnp.zeros((B,), jnp.int32),
            done=jnp.asarray(~self.decoding), steps=jnp.int32(0), penalties=self._penalties())
        carry = decode_steps(self.params, carry, self._sampling(), self.stop_ids, jnp.asarray(self._max_new()),
                             cfg=self.cfg, max_steps=N, K=K, max_seq=self.max_seq)
        self.state, self.last = carry.state, carry.last
        pen = carry.penalties  # the carry was donated: keep its (returned) penalty arrays
        self.counts, self._pen = pen.counts, (pen.presence, pen.frequency, pen.bias)
        zeros = np.zeros(B, np.int32)
        return (*jax.device_get((carry.count, carry.done, carry.tokens, carry.logprob, carry.top_ids, carry.top_lp)),
                zeros, zeros)

    def _spec_dispatch(self):
        B, k = self.slots, self.k
        N = self.steps * (k + 1)  # a step commits up to k+1 tokens
        done = jnp.asarray(~self.decoding) | (self.state.lengths + k + 1 > self.max_seq)
        carry = SpecCarry(
            state=self.state, last=self.last, pend_h=self.pend_h, pend_tok=self.pend_tok, pend_n=self.pend_n,
            tokens=jnp.zeros((B, N), jnp.int32), logprob=jnp.zeros((B, N), jnp.float32),
            count=jnp.zeros((B,), jnp.int32), done=done, steps=jnp.int32(0), drafted=jnp.zeros((B,), jnp.int32),
            accepted=jnp.zeros((B,), jnp.int32), accepted_at=jnp.zeros((B, k), jnp.int32))
        carry = spec_steps(self.params, carry, self._sampling(), self.stop_ids, jnp.asarray(self._max_new()), None,
                           cfg=self.cfg, k=k, max_steps=self.steps, max_seq=self.max_seq)
        self.state, self.last = carry.state, carry.last
        self.pend_h, self.pend_tok, self.pend_n = carry.pend_h, carry.pend_tok, carry.pend_n
        count, done, toks, lp, drafted, accepted = jax.device_get(
            (carry.count, carry.done, carry.tokens, carry.logprob, carry.drafted, carry.accepted))
        return count, done, toks, lp, None, None, drafted, accepted

    def _max_new(self) -> np.ndarray:
        return np.maximum(self.remaining, 1)

    def warm_up(self) -> None:
        """Compile every program serving runs (row joins, prefill chunk, decode dispatch, a prefix-cache hit and
        a row snapshot) before reporting ready."""
        bos = self.cfg.bos_token_id
        for prompt in ([bos], [bos, bos]) if self.cache.capacity else ([bos],):  # the second one hits the cache
            self.join(0, prompt, 2, RowSampling())
            self.prefill_step()
            self.decoding[0], self.remaining[0] = True, 1  # even if the first token was a stop id
            self.decode_step()
            self.snapshot(0)
            self.leave(0)
        self.cache.clear()
