"""Continuous batching: one thread owns the `SlotEngine`; requests wait in a bounded queue, join free slots,
are prefilled chunk by chunk between decode dispatches, and leave when done, stopped or aborted.

The front ends (HTTP, gRPC) run on an asyncio loop; they `submit` a `Request` and read its `RequestOutput`s
from an `OutputStream`, which the engine thread fills through `loop.call_soon_threadsafe`. An abort (client
gone, deadline, stop string) takes effect before the next device step, so a slot is free within one dispatch.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from typing import Callable

from dsjax.serving.engine import RowSampling, SlotEngine, StepOutput

log = logging.getLogger("dsjax.serving")


class QueueFull(Exception):
    """The waiting queue is at its bound (HTTP 429, gRPC RESOURCE_EXHAUSTED)."""


class Draining(Exception):
    """The server is shutting down and takes no new requests (HTTP 503, gRPC UNAVAILABLE)."""


@dataclasses.dataclass
class RequestOutput:
    """New tokens of one request since the last output. `finish_reason`: None while running, else
    "stop" | "length" | "abort" | "error"."""

    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]
    finish_reason: str | None = None
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    kv_source: str = "recompute"  # where those came from: local | peer | recompute


@dataclasses.dataclass
class Request:
    id: str
    prompt: list[int]
    max_tokens: int
    sampling: RowSampling = RowSampling()
    top_logprobs: int = 0
    stop_token_ids: frozenset[int] = frozenset()  # besides the engine's (EOS); checked on the host
    emit: Callable[[RequestOutput], None] = lambda out: None
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    first_token_at: float | None = None
    admitted_at: float | None = None
    generated: int = 0
    slot: int | None = None
    cached_tokens: int = 0
    conversation: str | None = None  # KV handoff: the conversation id (HMAC'd), snapshotted after the turn
    start: object = None             # kv_handoff.Start: a state row to start from
    kv_source: str = "recompute"
    output: list[int] = dataclasses.field(default_factory=list)
    images: object = None            # dsjax.vision PreparedPrompt: the prompt's images (V4.1 vision)


class OutputStream:
    """The outputs of one request on an asyncio loop; `emit` may be called from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None):
        self.loop = loop or asyncio.get_running_loop()
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

    def emit(self, out: RequestOutput) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, out)
        except RuntimeError:  # the loop has closed (shutdown): nobody is listening any more
            pass

    async def __aiter__(self):
        while True:
            out = await self.queue.get()
            yield out
            if out.finish_reason is not None:
                return


class Scheduler:
    """`submit` / `abort` from any thread; `start` runs the engine loop in a daemon thread."""

    def __init__(self, engine: SlotEngine, *, max_queue: int, metrics=None, kv=None):
        self.engine, self.max_queue, self.metrics, self.kv = engine, max_queue, metrics, kv
        self._waiting: collections.deque[Request] = collections.deque()
        self._aborts: dict[str, str] = {}
        self._by_id: dict[str, Request] = {}
        self._slot_owner: dict[int, Request] = {}
        self._cv = threading.Condition()
        self._stop = False
        self.draining = False
        self._thread: threading.Thread | None = None
        self.dispatches = 0

    # ---- any thread ----

    def submit(self, req: Request) -> None:
        with self._cv:
            if self.draining or self._stop:
                raise Draining("the server is draining and accepts no new requests")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"the request queue is full ({self.max_queue} waiting); retry later")
            if req.id in self._by_id:
                raise ValueError(f"request id {req.id!r} is already in use")
            self._waiting.append(req)
            self._by_id[req.id] = req
            self._cv.notify()
        self._gauges()

    def abort(self, request_id: str, reason: str = "abort") -> bool:
        """Ask to stop a request; True if it was known and not yet finished."""
        with self._cv:
            if request_id not in self._by_id:
                return False
            self._aborts[request_id] = reason
            self._cv.notify()
            return True

    def request_ids(self) -> list[str]:
        """Requests waiting or running, oldest first."""
        with self._cv:
            return list(self._by_id)

    def queue_depth(self) -> int:
        return len(self._waiting)

    def running(self) -> int:
        return len(self._slot_owner)

    def idle(self) -> bool:
        with self._cv:
            return not self._by_id

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="dsjax-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def wait_idle(self, timeout: float) -> bool:
        """Block until nothing waits or runs (graceful drain); False on timeout."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.idle():
                return True
            time.sleep(0.02)
        return self.idle()

    # ---- engine thread ----

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self._by_id:
                    self._cv.wait()
                if self._stop:
                    break
                aborts, self._aborts = self._aborts, {}
            try:
                self._apply_aborts(aborts)
                self._admit()
                self._handle(self.engine.prefill_step())
                self._handle(self.engine.decode_step())
                self.dispatches += 1
            except Exception as e:  # a failed device step: fail what runs, start the batch afresh, keep serving
                log.exception("engine step failed")
                self._fail_all(f"internal error in the engine: {type(e).__name__}: {e}")
            self._gauges()
        self._fail_all("the server stopped", reason="abort")

    def _apply_aborts(self, aborts: dict[str, str]) -> None:
        for rid, reason in aborts.items():
            with self._cv:
                req = self._by_id.get(rid)
                if req is None:
                    continue
                if req.slot is None:
                    try:
                        self._waiting.remove(req)
                    except ValueError:
                        pass
            if req.slot is not None:
                self.engine.leave(req.slot)
            self._finish(req, RequestOutput([], [], [], finish_reason=reason, cached_tokens=req.cached_tokens))

    def _admit(self) -> None:
        for slot in self.engine.free_slots():
            with self._cv:
                if not self._waiting:
                    return
                req = self._waiting.popleft()
            req.slot = slot
            req.admitted_at = time.monotonic()
            self._slot_owner[slot] = req
            extra = {"start": req.start} if req.start is not None else {}
            if req.images is not None:
                extra["images"] = req.images
            req.cached_tokens = self.engine.join(slot, req.prompt, req.max_tokens, req.sampling, req.top_logprobs,
                                                 **extra)
            used = req.start is not None and req.cached_tokens == req.start.tokens
            req.kv_source = req.start.source if used else "local" if req.cached_tokens else "recompute"
            req.start = None  # the row is in the engine now
            if self.metrics and req.conversation:
                self.metrics.kv_source.labels(source=req.kv_source).inc()
            if self.metrics:
                self.metrics.queue_time.observe(time.monotonic() - req.arrival)
                self.metrics.prompt_tokens.inc(len(req.prompt))
                self.metrics.prefix_cache_queries.inc()
                if req.cached_tokens:
                    self.metrics.prefix_cache_hits.inc()
                    self.metrics.cached_prompt_tokens.inc(req.cached_tokens)

    def _handle(self, outputs: list[StepOutput]) -> None:
        now = time.monotonic()
        for o in outputs:
            req = self._slot_owner.get(o.slot)
            if req is None:
                continue
            tokens, finished = o.tokens, o.finished
            for i, t in enumerate(tokens):
                if t in req.stop_token_ids:
                    tokens, finished = tokens[:i + 1], "stop"
                    self.engine.leave(o.slot)
                    break
            n = len(tokens)
            out = RequestOutput(tokens, o.logprobs[:n], o.top[:n], finish_reason=finished,
                                cached_tokens=req.cached_tokens, kv_source=req.kv_source)
            if self.kv is not None and req.conversation:
                if not req.output and n:  # the prefill just ended: its state holds exactly the prompt
                    self.kv.snapshot(req.conversation, "prompt", req.prompt, self.engine.snapshot(o.slot))
                req.output.extend(tokens)
                if finished is not None:
                    self.kv.snapshot(req.conversation, "final", req.prompt + req.output, self.engine.snapshot(o.slot))
            if req.first_token_at is None and n:
                req.first_token_at = now
                if self.kv is not None and req.admitted_at is not None:  # what a recompute costs here: the budget
                    self.kv.prefill.observe(len(req.prompt) - req.cached_tokens, now - req.admitted_at)
                if self.metrics:
                    self.metrics.ttft.observe(now - req.arrival)
            req.generated += n
            if self.metrics:
                self.metrics.generation_tokens.inc(n)
                if o.row_steps:
                    self.metrics.speculative(o.row_steps, o.drafted, o.accepted, len(o.tokens))
            if finished is None:
                req.emit(out)
            else:
                self._finish(req, out)

    def _finish(self, req: Request, out: RequestOutput) -> None:
        if req.slot is not None:
            self._slot_owner.pop(req.slot, None)
            req.slot = None
        with self._cv:
            self._by_id.pop(req.id, None)
        if self.metrics:
            self.metrics.finished(req, out.finish_reason)
        req.emit(out)

    def _fail_all(self, message: str, reason: str = "error") -> None:
        with self._cv:
            reqs = list(self._by_id.values())
            self._waiting.clear()
        for req in reqs:
            if req.slot is not None:
                self.engine.leave(req.slot)
            self._finish(req, RequestOutput([], [], [], finish_reason=reason, error=message))
        if reason == "error":
            self.engine.reset_all()

    def _gauges(self) -> None:
        if self.metrics:
            self.metrics.queue_depth.set(len(self._waiting))
            self.metrics.running.set(len(self._slot_owner))
