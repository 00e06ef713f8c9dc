"""Token ids -> text for one response: incremental UTF-8-safe decoding and stop strings.

Text that could still be the start of a stop string is held back until it cannot; once a stop string
appears, the text ends before it and `stopped` is set (the caller then aborts the request in the engine).
"""

from __future__ import annotations

from dsjax.chat.parsing import partial_marker
from dsjax.tokenizer import Tokenizer


class OutputText:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = (), *, skip_special_tokens: bool = True):
        self._decoder = tokenizer.incremental_decoder(skip_special_tokens=skip_special_tokens)
        self.stop = tuple(s for s in stop if s)
        self._held = ""
        self.stopped = False
        self.tokens_used = 0  # tokens consumed up to and including the one that completed a stop string

    def add(self, token_ids: list[int]) -> str:
        """The text that is final after these tokens (fed one by one, so a stop string ends at its token)."""
        out = []
        for t in token_ids:
            if self.stopped:
                break
            self.tokens_used += 1
            out.append(self._push(self._decoder.add([t])))
        return "".join(out)

    def flush(self) -> str:
        if self.stopped:
            return ""
        text = self._push(self._decoder.flush(), final=True)
        return text

    def _push(self, text: str, final: bool = False) -> str:
        buf = self._held + text
        if self.stop:
            hits = [(i, s) for s in self.stop if (i := buf.find(s)) >= 0]
            if hits:
                self.stopped = True
                self._held = ""
                return buf[:min(i for i, _ in hits)]
        keep = 0 if final else partial_marker(buf, self.stop)
        self._held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep]
