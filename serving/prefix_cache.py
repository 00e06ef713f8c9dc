"""A local prefix cache: the decode state of recent prompts, one batch row each, kept on the device.

When a prompt ends its prefill, its row of the state is copied out under its token ids. A later request whose
prompt *extends* a cached one (the next turn of a conversation: the history is a prefix of the new prompt)
starts from that row and prefills only the rest. The state after n tokens cannot be rewound, so only whole
cached prompts match, and at least one new token must remain (its logits give the first token). Longest match
wins; least recently used entries are dropped first. Entries are keyed by token ids alone — one model, one
key: a multi-tenant server would namespace them by the authenticated identity (serving-kv-handoff.md §5).
"""

from __future__ import annotations

import collections
import functools

import jax


@jax.jit
def take_row(state, slot):
    """Row `slot` of every array of the state (leading dimension kept: [1, ...])."""
    return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, slot, 1, axis=0), state)


@functools.partial(jax.jit, donate_argnames=("state",))
def put_row(state, row, slot):
    """`row` (from take_row) written into row `slot` of the state."""
    return jax.tree.map(lambda a, r: jax.lax.dynamic_update_slice_in_dim(a, r, slot, axis=0), state, row)


class PrefixCache:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._rows: collections.OrderedDict[tuple[int, ...], object] = collections.OrderedDict()
        self.queries = self.hits = self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._rows)

    def lookup(self, prompt) -> tuple[int, object]:
        """(cached tokens, row state) of the longest cached prompt that is a proper prefix of `prompt`, or (0, None)."""
        if not self.capacity:
            return 0, None
        self.queries += 1
        prompt = tuple(int(t) for t in prompt)
        best = max((k for k in self._rows if len(k) < len(prompt) and prompt[:len(k)] == k), key=len, default=None)
        if best is None:
            return 0, None
        self._rows.move_to_end(best)
        self.hits += 1
        self.hit_tokens += len(best)
        return len(best), self._rows[best]

    def store(self, prompt, row) -> None:
        if not self.capacity:
            return
        key = tuple(int(t) for t in prompt)
        self._rows[key] = row
        self._rows.move_to_end(key)
        while len(self._rows) > self.capacity:
            self._rows.popitem(last=False)

    def clear(self) -> None:
        self._rows.clear()
