"""Host side of generation: validate, prefill in fixed-size chunks, then dispatch the on-device loop.

The host touches tokens once per dispatch (`steps_per_dispatch` decode steps), which is also the granularity
of `stream`. Shapes are bucketed (batch slots, token buffer) so a handful of compiles serve every request.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dsjax.config import ModelConfig
from dsjax.decode import LoopCarry, decode_steps, finish_flags, record
from dsjax.errors import InputError
from dsjax.model import forward_hidden_chunk, head_logits
from dsjax.mtp import mtp_hidden
from dsjax.dspark import init_rings
from dsjax.dspark_loop import DSparkCarry, dspark_steps, prefill_chunk as dspark_prefill
from dsjax.speculative import Forced, SpecCarry, spec_steps
from dsjax.sampling import SamplingParams, make_sampling, sample
from dsjax.sharding import active_mesh, axis_size, gather_vocab
from dsjax.state import init_state


@dataclasses.dataclass
class Generation:
    tokens: list[int]
    finish_reason: str                  # "stop" | "length"
    logprobs: list[dict] | None = None  # per token: {"logprob", "top": [(id, logprob), ...]}
    stats: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class GenerateOptions:
    max_new_tokens: int
    temperature: float | Sequence[float] = 0.0
    top_p: float | Sequence[float] = 1.0
    top_k: int | Sequence[int] = 0
    min_p: float | Sequence[float] = 0.0
    seed: int | Sequence[int] = 0
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int = 0
    steps_per_dispatch: int = 32
    prefill_chunk: int = 256
    speculative: str | None = None      # None | "mtp" | "dspark"
    num_draft_tokens: int | None = None  # default: 2 (mtp), the DSpark block size (dspark)
    adaptive_verification: float | None = None  # dspark: verify drafts while sigmoid(confidence) >= this
    prefill_schedule: str = "exact"     # V4.1: "replay" = CED prefill with SWA bounded replay (dsjax.v41_replay)
    forced_acceptance: tuple[int, ...] | None = None  # benchmarks only: accepted drafts per step, "simulated"
    oracle_drafts: object = None        # tests only: speculative.OracleDrafts replacing the model's drafts

    def draft_tokens(self, cfg: ModelConfig) -> int:
        if self.num_draft_tokens is not None:
            return self.num_draft_tokens
        return cfg.dspark_block_size if self.speculative == "dspark" else 2


def _bucket(n: int, lo: int = 16) -> int:
    b = lo
    while b < n:
        b *= 2
    return b


def stop_id_row(stop_token_ids) -> jax.Array:
    """The distinct stop ids padded with -1 (no token's id) to a bucket of 8: requests with 0-8 stop ids share
    one compiled loop instead of one per count."""
    ids = sorted({int(t) for t in stop_token_ids})
    row = np.full(_bucket(len(ids), 8), -1, np.int32)
    row[:len(ids)] = ids
    return jnp.asarray(row)


@functools.partial(jax.jit, static_argnames=("cfg", "mtp"), donate_argnames=("state",))
def _prefill_chunk(params, tokens, next_tokens, state, n_valid, n_mtp, image=None, *, cfg: ModelConfig, mtp: bool):
    """One prompt chunk; with `mtp`, the MTP block also consumes the chunk's positions whose next token is known.
    `image`: (span rows, index [B, C]) of a chunk holding image-span positions (see forward_hidden41)."""
    start = state.lengths
    h, state = forward_hidden_chunk(params, cfg, tokens, state, n_valid, image=image)
    if mtp:
        _, ring = mtp_hidden(params, cfg, h, next_tokens, state.mtp[0], start, n_mtp)
        state = dataclasses.replace(state, mtp=(ring,))
    return head_logits(h, params, cfg, params.hc_head, params.norm), h, state


@functools.partial(jax.jit, static_argnames=("cfg", "K", "max_seq"), donate_argnames=("carry",))
def _first_token(carry: LoopCarry, logits, sp: SamplingParams, stop_ids, max_new, *, cfg, K: int, max_seq: int):
    active = ~carry.done
    logits = gather_vocab(logits, cfg.sharding)
    tok = sample(logits, sp, carry.state.lengths)
    carry = record(carry, tok, logits, K, active)
    return dataclasses.replace(carry, done=finish_flags(carry, tok, active, stop_ids, max_new, max_seq))


def _chunk_ids(rows, slots: int, start: int, C: int):
    """int32 [slots, C]: each prompt's tokens [start, start + C), zero-padded (rows past the prompts: zeros)."""
    chunk = np.zeros((slots, C), np.int32)
    for b, r in enumerate(rows):
        part = r[start:start + C]
        chunk[b, :len(part)] = part
    return chunk


def _chunk_image(vision, slots: int, start: int, C: int):
    """The model's `image` argument for the prompt chunk at `start` (None when no row's chunk holds an image)."""
    if vision is None:
        return None
    index = vision.chunk(slots, start, C)
    return (vision.rows, jnp.asarray(index)) if (index >= 0).any() else None


def _replay_prefill(params, cfg: ModelConfig, rows, slots: int, C: int, state, rings, vision=None):
    """V4.1's CED prefill with SWA bounded replay (dsjax.v41_replay): (logits and DSpark main_x at each row's
    last prompt position, state, rings)."""
    from dsjax import dspark
    from dsjax.v41_replay import last_logits, prefill_replay

    lengths = np.array([len(r) for r in rows] + [1] * (slots - len(rows)))
    chunks = [(jnp.asarray(_chunk_ids(rows, slots, start, C)), jnp.asarray(np.clip(lengths - start, 0, C).astype(np.int32)),
               _chunk_image(vision, slots, start, C)) for start in range(0, int(lengths.max()), C)]
    y, taps, first, state = prefill_replay(params, cfg, chunks, state, lengths)
    logits = last_logits(params, cfg, y, lengths, first)
    last_h = None
    if rings is not None:
        rings, main_x = dspark.seed_from_chunk(params, cfg, rings, taps, first, state.lengths - first)
        last_h = main_x[jnp.arange(slots), jnp.asarray(lengths) - 1 - first]
    return logits, last_h, state, rings


def validate(cfg: ModelConfig, prompts, opts: GenerateOptions, max_seq: int, max_batch: int):
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise InputError("prompts must be a non-empty list of token-id lists")
    if len(prompts) > max_batch:
        raise InputError(f"{len(prompts)} prompts exceed max_batch={max_batch}; load with a larger max_batch")
    out = []
    for i, p in enumerate(prompts):
        a = np.asarray(p)
        if a.ndim != 1 or a.size == 0:
            raise InputError(f"prompt {i} is empty or not a flat list of token ids")
        if not np.issubdtype(a.dtype, np.integer):
            raise InputError(f"prompt {i}: token ids must be integers, got {a.dtype}")
        if (a < 0).any() or (a >= cfg.vocab_size).any():
            bad = int(a[(a < 0) | (a >= cfg.vocab_size)][0])
            raise InputError(f"prompt {i}: token id {bad} is out of range [0, {cfg.vocab_size})")
        if a.size >= max_seq:
            raise InputError(f"prompt {i} has {a.size} tokens; max_seq_len is {max_seq} (room is needed to generate)")
        out.append(a.astype(np.int32))
    if not isinstance(opts.max_new_tokens, (int, np.integer)) or opts.max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be a positive int, got {opts.max_new_tokens!r}")
    if opts.logprobs < 0 or opts.logprobs > 20:
        raise InputError(f"logprobs must lie in [0, 20], got {opts.logprobs}")
    if opts.speculative not in (None, "mtp", "dspark"):
        raise InputError(f"speculative={opts.speculative!r}: choose None, 'mtp' or 'dspark'")
    dspark = cfg.family == "v4.1" and cfg.dspark_block_size > 0
    if opts.speculative == "mtp" and (not cfg.n_mtp_layers or cfg.family == "v4.1"):
        raise InputError(f"speculative='mtp' needs an MTP head; {cfg.name} has none"
                         + (" (V4.1 drafts with speculative='dspark')" if dspark else " (n_mtp_layers=0)"))
    if opts.speculative == "dspark" and not dspark:
        raise InputError(f"speculative='dspark' needs a DSpark draft; {cfg.name} has none"
                         + (" (V4 drafts with speculative='mtp')" if cfg.family != "v4.1" else ""))
    most = cfg.dspark_block_size if opts.speculative == "dspark" else 8
    if opts.speculative and not 1 <= opts.draft_tokens(cfg) <= most:
        raise InputError(f"num_draft_tokens must lie in [1, {most}] for speculative={opts.speculative!r}, "
                         f"got {opts.num_draft_tokens}")
    if opts.adaptive_verification is not None and (opts.speculative != "dspark"
                                                   or not 0.0 <= opts.adaptive_verification <= 1.0):
        raise InputError("adaptive_verification is a confidence threshold in [0, 1] for speculative='dspark', "
                         f"got {opts.adaptive_verification!r} with speculative={opts.speculative!r}")
    if opts.speculative and opts.logprobs:
        raise InputError("logprobs with speculative decoding: only the chosen token's logprob is reported; use logprobs=0")
    for t in opts.stop_token_ids:
        if not 0 <= int(t) < cfg.vocab_size:
            raise InputError(f"stop token id {t} is out of range [0, {cfg.vocab_size})")
    from dsjax.v41_replay import SCHEDULES, decoder_start
    if opts.prefill_schedule not in SCHEDULES:
        raise InputError(f"prefill_schedule={opts.prefill_schedule!r}: choose 'exact' or 'replay'")
    if opts.prefill_schedule == "replay":
        from dsjax.config import ConfigError
        try:
            decoder_start(cfg)
        except ConfigError as e:
            raise InputError(f"prefill_schedule='replay': {e}") from None
    return out


def stream(params, cfg: ModelConfig, prompts, opts: GenerateOptions, *, max_seq: int, max_batch: int,
           images=None) -> Iterator[tuple[list[list[int]], list[bool], dict]]:
    """Yields (new tokens per row, done per row, stats) once per device dispatch; the first yield is the
    prefill's token. `images` (V4.1 with a vision tower): one list of images per prompt, each prompt holding one
    `image_token_id` placeholder per image (see dsjax.vision.prepare)."""
    vision = None
    if images is not None:
        from dsjax.vision import prepare

        validate(cfg, prompts, dataclasses.replace(opts, max_new_tokens=max(opts.max_new_tokens, 1)), 1 << 62,
                 max_batch)
        prompts, vision = prepare(params, cfg, prompts, images)
        prompts = [p.tolist() for p in prompts]
    rows = validate(cfg, prompts, opts, max_seq, max_batch)
    B = len(rows)
    mesh = active_mesh()
    dp = axis_size(mesh, cfg.sharding.mesh_axes("batch")) if mesh is not None else 1
    slots = max(_bucket(B, 1), dp)  # the batch splits evenly over the data-parallel axis
    sp = make_sampling(B, temperature=opts.temperature, top_k=opts.top_k, top_p=opts.top_p, min_p=opts.min_p,
                       seed=opts.seed)
    pad = slots - B
    sp = jax.tree.map(lambda a: jnp.concatenate([a, jnp.repeat(a[-1:], pad, axis=0)]) if pad else a, sp)
    N = _bucket(opts.max_new_tokens)
    K = opts.logprobs
    stop_ids = stop_id_row(opts.stop_token_ids)
    max_new = jnp.asarray([opts.max_new_tokens] * B + [1] * pad, jnp.int32)
    lengths = np.array([len(r) for r in rows] + [1] * pad)
    t0 = time.perf_counter()
    # prefill: fixed-size chunks, every row at its own length
    spec = opts.speculative == "mtp"
    dspark = opts.speculative == "dspark"
    C = min(opts.prefill_chunk, _bucket(int(lengths.max())))
    state = init_state(cfg, slots, max_seq, with_mtp=spec)
    rings = init_rings(cfg, slots) if dspark else None
    last_logits = jnp.zeros((slots, cfg.vocab_size), jnp.float32)
    last_h = None
    replay = opts.prefill_schedule == "replay"
    for start in range(0, int(lengths.max()) if not replay else 0, C):
        chunk, nxt = _chunk_ids(rows, slots, start, C), _chunk_ids(rows, slots, start + 1, C)
        n_valid = np.clip(lengths - start, 0, C).astype(np.int32)
        n_mtp = np.clip(lengths - 1 - start, 0, C).astype(np.int32)
        image = _chunk_image(vision, slots, start, C)
        if dspark:
            logits, h, state, rings = dspark_prefill(params, jnp.asarray(chunk), state, rings, jnp.asarray(n_valid),
                                                     image, cfg=cfg)
        else:
            logits, h, state = _prefill_chunk(params, jnp.asarray(chunk), jnp.asarray(nxt), state,
                                              jnp.asarray(n_valid), jnp.asarray(n_mtp), image, cfg=cfg, mtp=spec)
        last = jnp.asarray(np.clip(lengths - 1 - start, 0, C - 1))
        here = jnp.asarray((lengths - 1 >= start) & (lengths - 1 < start + C))
        last_logits = jnp.where(here[:, None], logits[jnp.arange(slots), last], last_logits)
        if spec or dspark:  # the MTP's streams / DSpark's main_x at the last prompt position
            hl = h[jnp.arange(slots), last]
            last_h = hl if last_h is None else jnp.where(here.reshape((-1,) + (1,) * (hl.ndim - 1)), hl, last_h)
    if replay:
        last_logits, last_h, state, rings = _replay_prefill(params, cfg, rows, slots, C, state, rings, vision)
    carry = LoopCarry(
        state=state, last=jnp.zeros((slots,), jnp.int32), tokens=jnp.zeros((slots, N), jnp.int32),
        logprob=jnp.zeros((slots, N), jnp.float32), top_ids=jnp.zeros((slots, N, K), jnp.int32),
        top_lp=jnp.zeros((slots, N, K), jnp.float32), count=jnp.zeros((slots,), jnp.int32),
        done=jnp.asarray([False] * B + [True] * pad), steps=jnp.int32(0))
    carry = _first_token(carry, last_logits, sp, stop_ids, max_new, cfg=cfg, K=K, max_seq=max_seq)
    ttft = time.perf_counter() - t0
    seen = np.zeros(slots, np.int64)

    def emit(carry):
        nonlocal seen
        count, done, toks = jax.device_get((carry.count, carry.done, carry.tokens))
        new = [toks[b, seen[b]:count[b]].tolist() for b in range(B)]
        seen = count.copy()
        return new, done[:B].tolist()

    new, done = emit(carry)
    yield new, done, {"ttft_s": ttft, "decode_s": 0.0, "steps": 0, "carry": carry}
    t1 = time.perf_counter()
    k = opts.draft_tokens(cfg)
    K1 = k + 1
    forced = None if opts.forced_acceptance is None else Forced(jnp.asarray(opts.forced_acceptance, jnp.int32))
    if dspark:
        zeros = lambda *shape: jnp.zeros((slots,) + shape, jnp.int32)  # distinct buffers: the carry is donated
        carry = DSparkCarry(state=carry.state, rings=rings, main_x=last_h, last=carry.last, tokens=carry.tokens,
                            logprob=carry.logprob, count=carry.count, done=carry.done | (carry.state.lengths + K1 > max_seq),
                            steps=carry.steps, drafted=zeros(), accepted=zeros(), accepted_at=zeros(k), verified=zeros())
        adaptive = None if opts.adaptive_verification is None else jnp.float32(opts.adaptive_verification)
    if spec:
        pend_h = jnp.zeros((slots, K1) + last_h.shape[1:], last_h.dtype).at[:, 0].set(last_h)
        pend_tok = jnp.zeros((slots, K1), jnp.int32).at[:, 0].set(carry.tokens[:, 0])
        carry = SpecCarry(state=carry.state, last=carry.last, pend_h=pend_h, pend_tok=pend_tok,
                          pend_n=jnp.ones((slots,), jnp.int32), tokens=carry.tokens, logprob=carry.logprob,
                          count=carry.count, done=carry.done | (carry.state.lengths + K1 > max_seq),
                          steps=carry.steps, drafted=jnp.zeros((slots,), jnp.int32),
                          accepted=jnp.zeros((slots,), jnp.int32), accepted_at=jnp.zeros((slots, k), jnp.int32))
    while not all(done):
        if dspark:
            carry = dspark_steps(params, carry, sp, stop_ids, max_new, forced, opts.oracle_drafts, adaptive, cfg=cfg,
                                 k=k, max_steps=opts.steps_per_dispatch, max_seq=max_seq)
        elif spec:
            carry = spec_steps(params, carry, sp, stop_ids, max_new, forced, opts.oracle_drafts, cfg=cfg, k=k,
                               max_steps=opts.steps_per_dispatch, max_seq=max_seq)
        else:
            carry = decode_steps(params, carry, sp, stop_ids, max_new, cfg=cfg, max_steps=opts.steps_per_dispatch,
                                 K=K, max_seq=max_seq)
        new, done = emit(carry)
        yield new, done, {"ttft_s": ttft, "decode_s": time.perf_counter() - t1, "steps": int(carry.steps),
                          "carry": carry}


def generate(params, cfg: ModelConfig, prompts, opts: GenerateOptions, *, max_seq: int, max_batch: int,
             images=None) -> list[Generation]:
    B = len(prompts) if isinstance(prompts, (list, tuple)) else 0
    out = [[] for _ in range(B)]
    stats: dict = {}
    for new, done, stats in stream(params, cfg, prompts, opts, max_seq=max_seq, max_batch=max_batch, images=images):
        for b, toks in enumerate(new):
            out[b].extend(toks)
        carry = stats["carry"]
    gens = []
    stop = set(int(t) for t in opts.stop_token_ids)
    lp = jax.device_get(carry.logprob)
    top_ids, top_lp = (jax.device_get((carry.top_ids, carry.top_lp)) if isinstance(carry, LoopCarry) else (None, None))
    spec_stats = None
    if isinstance(carry, (SpecCarry, DSparkCarry)):
        spec_stats = jax.device_get((carry.drafted, carry.accepted, carry.accepted_at))
        verified = jax.device_get(carry.verified) if isinstance(carry, DSparkCarry) else spec_stats[0]
    for b in range(B):
        toks = out[b]
        reason = "stop" if toks and toks[-1] in stop else "length"
        logprobs = None
        if opts.logprobs:
            logprobs = [{"logprob": float(lp[b, i]),
                         "top": [(int(top_ids[b, i, j]), float(top_lp[b, i, j])) for j in range(opts.logprobs)]}
                        for i in range(len(toks))]
        st = {"steps": stats.get("steps", 0), "drafted": 0, "accepted": 0, "acceptance_length": 1.0,
              "ttft_s": stats.get("ttft_s", 0.0), "decode_s": stats.get("decode_s", 0.0)}
        if spec_stats is not None:
            drafted, accepted, at = (int(spec_stats[0][b]), int(spec_stats[1][b]), spec_stats[2][b])
            k = opts.draft_tokens(cfg)
            row_steps = drafted // k if k else 0
            st.update(drafted=drafted, accepted=accepted, row_steps=row_steps, verified=int(verified[b]),
                      acceptance_length=(len(toks) - 1) / row_steps if row_steps else 1.0,
                      acceptance_per_position=[int(x) / row_steps if row_steps else 0.0 for x in at],
                      simulated=opts.forced_acceptance is not None)
        gens.append(Generation(tokens=toks, finish_reason=reason, logprobs=logprobs, stats=st))
    return gens
