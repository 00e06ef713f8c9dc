"""How long a turn may spend pulling its KV from a peer before recomputing is the better deal.

The handoff budget is `min(time left before the request's deadline, α × the estimated prefill time of the tokens
the pull would save)` (serving-kv-handoff.md §8.4), clamped to [floor, cap]: the cap is `--kv-handoff-timeout`,
the floor keeps a pull possible where our fixed-shape prefill of a short prompt is estimated below one RPC round
trip (a failed pull costs at most its budget). The prefill estimate comes from this server's own measurements:
an exponential average of seconds per prefill chunk, observed from admission to first token of each request
(which includes the decode dispatches interleaved with it, as a recompute would) — the first observation, which
pays for compilation, is dropped.
"""

from __future__ import annotations

import dataclasses
import math
import threading


@dataclasses.dataclass
class PrefillClock:
    """Seconds per prefill chunk of `chunk_tokens`, averaged over this server's recent prompts."""
    chunk_tokens: int
    weight: float = 0.2               # of the newest observation in the average
    seconds_per_chunk: float | None = None
    seen: int = 0
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def observe(self, tokens: int, seconds: float) -> None:
        """A prompt of `tokens` computed tokens took `seconds` from admission to its first token."""
        if tokens <= 0 or seconds <= 0:
            return
        per_chunk = seconds / math.ceil(tokens / self.chunk_tokens)
        with self._lock:
            self.seen += 1
            if self.seen == 1:
                return  # the first prompt compiles the prefill program
            old = self.seconds_per_chunk
            self.seconds_per_chunk = per_chunk if old is None else (1 - self.weight) * old + self.weight * per_chunk

    def estimate(self, tokens: int) -> float | None:
        """Seconds to prefill `tokens` tokens here; None before a measurement exists."""
        if self.seconds_per_chunk is None:
            return None
        return math.ceil(max(tokens, 0) / self.chunk_tokens) * self.seconds_per_chunk


def handoff_budget(prefill_estimate_s: float | None, deadline_left_s: float | None, *, alpha: float, floor_s: float,
                   cap_s: float) -> float:
    """Seconds the pull may take: α × the prefill it saves within [floor, cap] (the cap without an estimate),
    never past the request's deadline. 0 means: do not try."""
    budget = cap_s if prefill_estimate_s is None else min(cap_s, max(floor_s, alpha * prefill_estimate_s))
    if deadline_left_s is not None:
        budget = min(budget, deadline_left_s)
    return max(0.0, budget)
