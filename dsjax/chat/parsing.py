"""Model output -> reasoning, content and tool calls, incrementally (token by token) and without exceptions.

A V4/V4.1 assistant turn, as generated after the prompt's `<｜Assistant｜><think>` (thinking) or
`<｜Assistant｜></think>` (chat)::

    {reasoning}</think>{content}\\n\\n<｜DSML｜tool_calls>\\n<｜DSML｜invoke name="f">...</｜DSML｜tool_calls><EOS>

DeepSeek's reference parser (`parse_message_from_completion_text`) raises on anything malformed; a server
cannot. `OutputParser` streams `Event`s as text arrives and always ends with a `ParsedOutput`; whatever it
had to repair or drop is listed in `ParsedOutput.errors`. It accepts both DSML dialects (V4 `tool_calls`,
V4.1 ` calls`) whatever the family, a tool-call block begun inside an unclosed reasoning block, a missing
blank line before the block, unclosed invokes and blocks, and text after the block.

Text is held back only while it could still be the start of a marker (`</think>`, EOS, `<｜DSML｜…`) or
newlines that would be dropped before a tool-call block; everything else is emitted at once.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from dsjax.chat.dsml import (CALLS_CLOSE_RE, CALLS_OPEN_RE, DSML, INVOKE_CLOSE_RE, INVOKE_OPEN_RE, V4_DIALECT,
                             V41_DIALECT, ToolCall, parse_invoke)
from dsjax.tokenizer import EOS, THINK_END, THINK_START, Tokenizer, check_family

_MARKERS = (THINK_END, EOS, V4_DIALECT.calls_open, V41_DIALECT.calls_open)
_TAG_START = "<" + DSML


@dataclasses.dataclass(frozen=True)
class Event:
    """One streamed piece: reasoning or content text, or a completed tool call."""

    kind: Literal["reasoning", "content", "tool_call"]
    text: str = ""
    tool_call: ToolCall | None = None


@dataclasses.dataclass
class ParsedOutput:
    """A whole assistant turn. `ended` is True when EOS was seen; `errors` lists every repair made."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = dataclasses.field(default_factory=list)
    errors: list[str] = dataclasses.field(default_factory=list)
    ended: bool = False

    def to_openai_message(self) -> dict:
        message = {"role": "assistant", "content": self.content, "reasoning_content": self.reasoning}
        if self.tool_calls:
            message["tool_calls"] = [call.to_openai() for call in self.tool_calls]
        return message


class OutputParser:
    """Incremental parser of one assistant turn.

    `feed(text)` / `feed_ids(ids)` return the events completed so far; at the end call `flush()` for the
    held-back remainder (streaming) and `finish()` for the whole `ParsedOutput` (it flushes too).
    """

    def __init__(self, family: str = "v4", thinking: bool = True, tokenizer: Tokenizer | None = None):
        self.family = check_family(family)
        self.thinking = thinking
        self._decoder = tokenizer.incremental_decoder() if tokenizer is not None else None
        self._state = "reasoning" if thinking else "content"
        self._buffer = ""
        self._at_start = True  # nothing consumed yet: a leading <think> is skipped
        self._after_calls = False
        self._flushed = False
        self._out = ParsedOutput()

    # ---- input ----

    def feed(self, text: str) -> list[Event]:
        if self._flushed:
            self._note("text fed after finish() was ignored")
            return []
        self._buffer += text
        return self._advance(final=False)

    def feed_ids(self, token_ids: int | list[int]) -> list[Event]:
        if self._decoder is None:
            raise ValueError("OutputParser.feed_ids needs a tokenizer: OutputParser(family, thinking, tokenizer=...)")
        return self.feed(self._decoder.add(token_ids))

    def flush(self) -> list[Event]:
        """End of output: emit what was held back and record anything left unfinished."""
        if self._flushed:
            return []
        if self._decoder is not None:
            self._buffer += self._decoder.flush()
        events = self._advance(final=True)
        self._flushed = True
        return events

    def finish(self) -> ParsedOutput:
        self.flush()
        return self._out

    # ---- state machine ----

    def _advance(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            step = {"reasoning": self._reasoning, "content": self._content, "calls": self._calls,
                    "done": self._done}[self._state]
            if not step(events, final):
                return events

    def _skip_leading_think(self) -> bool:
        """Drop a `<think>` the model repeats at the very start. False while that is still undecided."""
        if self._at_start and self._buffer:
            if THINK_START.startswith(self._buffer) and self._buffer != THINK_START:
                return False
            if self._buffer.startswith(THINK_START):
                self._buffer = self._buffer[len(THINK_START):]
                if self._state == "content":
                    self._note("a <think> block in chat mode was read as reasoning")
                    self._state = "reasoning"
            self._at_start = False
        return True

    def _reasoning(self, events: list[Event], final: bool) -> bool:
        if not self._skip_leading_think() and not final:
            return False
        end, calls, eos = self._buffer.find(THINK_END), CALLS_OPEN_RE.search(self._buffer), self._buffer.find(EOS)
        cut = min([p for p in (end, calls.start() if calls else -1, eos) if p >= 0], default=-1)
        if cut < 0:
            keep = 0 if final else _held_back(self._buffer)
            self._emit(events, "reasoning", self._buffer[:len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep:]
            if final:
                self._note("output ended inside reasoning (no </think>)")
            return False
        if cut == end:
            self._emit(events, "reasoning", self._buffer[:cut])
            self._buffer, self._state = self._buffer[cut + len(THINK_END):], "content"
        elif cut == eos:
            self._emit(events, "reasoning", self._buffer[:cut])
            self._note("output ended inside reasoning (no </think>)")
            self._buffer, self._state, self._out.ended = self._buffer[cut + len(EOS):], "done", True
        else:
            self._emit(events, "reasoning", _strip_block_gap(self._buffer[:cut]))
            self._note("tool calls began inside reasoning (no </think>)")
            self._buffer, self._state = self._buffer[calls.end():], "calls"
        return True

    def _content(self, events: list[Event], final: bool) -> bool:
        if not self._skip_leading_think() and not final:
            return False
        if self._state != "content":
            return True
        if self._after_calls:
            self._buffer = self._buffer.lstrip()
        calls, eos = CALLS_OPEN_RE.search(self._buffer), self._buffer.find(EOS)
        if calls and (eos < 0 or calls.start() < eos):
            self._emit(events, "content", _strip_block_gap(self._buffer[:calls.start()]))
            self._buffer, self._state = self._buffer[calls.end():], "calls"
        elif eos >= 0:
            self._emit(events, "content", self._buffer[:eos])
            self._buffer, self._state, self._out.ended = self._buffer[eos + len(EOS):], "done", True
        else:
            keep = 0 if final else _held_back(self._buffer)
            self._emit(events, "content", self._buffer[:len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return False
        return True

    def _calls(self, events: list[Event], final: bool) -> bool:
        self._buffer = self._buffer.lstrip()
        buffer = self._buffer
        if not buffer:
            if final:
                self._note("tool-call block not closed")
            return False
        if close := CALLS_CLOSE_RE.match(buffer):
            self._buffer, self._state, self._after_calls = buffer[close.end():], "content", True
        elif buffer.startswith(EOS):
            self._note("tool-call block not closed before EOS")
            self._buffer, self._state, self._out.ended = buffer[len(EOS):], "done", True
        elif opened := INVOKE_OPEN_RE.match(buffer):
            name = _invoke_name(opened.group(0))
            closed = INVOKE_CLOSE_RE.search(buffer, opened.end())
            stop = _first_stop(buffer, opened.end())
            if closed and (stop < 0 or closed.start() <= stop):
                self._emit_call(events, name, buffer[opened.end():closed.start()], note=None)
                self._buffer = buffer[closed.end():]
            elif stop >= 0:  # the block or the output ends inside this invoke: read what it has
                self._emit_call(events, name, buffer[opened.end():stop], note=f"tool call {name!r} not closed")
                self._buffer = buffer[stop:]
            elif final:
                self._note(f"output ended inside tool call {name!r}; the incomplete call was dropped")
                self._buffer = ""
                return False
            else:
                return False
        elif _TAG_START.startswith(buffer) or ("</" + DSML).startswith(buffer) or (
                buffer.startswith(("<" + DSML, "</" + DSML)) and ">" not in buffer):
            if final:
                self._note(f"output ended inside a DSML tag {buffer!r}")
                self._buffer = ""
            return False
        else:
            nxt = min([p for p in (buffer.find(_TAG_START, 1), buffer.find("</" + DSML, 1), buffer.find(EOS))
                       if p >= 0], default=-1)
            if nxt < 0 and not final:
                return False
            self._note(f"ignored text in tool-call block: {buffer[:nxt if nxt >= 0 else None][:80]!r}")
            self._buffer = buffer[nxt:] if nxt >= 0 else ""
        return True

    def _done(self, events: list[Event], final: bool) -> bool:
        if self._buffer.strip():
            self._note("text after EOS was ignored")
        self._buffer = ""
        return False

    # ---- output ----

    def _emit(self, events: list[Event], kind: str, text: str) -> None:
        if not text:
            return
        if kind == "content" and self._after_calls and text.strip():
            self._note("text after the tool-call block was kept as content")
            self._after_calls = False
        if kind == "reasoning":
            self._out.reasoning += text
        else:
            self._out.content += text
        events.append(Event(kind, text))

    def _emit_call(self, events: list[Event], name: str, body: str, note: str | None) -> None:
        call, notes = parse_invoke(name, body, index=len(self._out.tool_calls))
        if not name:
            notes.insert(0, "a tool call has no name")
        for message in ([note] if note else []) + notes:
            self._note(message)
        self._out.tool_calls.append(call)
        events.append(Event("tool_call", tool_call=call))

    def _note(self, message: str) -> None:
        if message not in self._out.errors:
            self._out.errors.append(message)


def parse_output(text: str, *, family: str = "v4", thinking: bool = True) -> ParsedOutput:
    """Parse a whole assistant turn at once (same rules as streaming)."""
    parser = OutputParser(family, thinking)
    parser.feed(text)
    return parser.finish()


def partial_marker(buffer: str, markers) -> int:
    """Length of the longest tail of `buffer` that is a proper prefix of one of `markers`: text a streamer must
    hold back until the next characters say whether a marker (or a stop string) begins there."""
    keep = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(buffer)), keep, -1):
            if buffer.endswith(marker[:n]):
                keep = n
                break
    return keep


def _held_back(buffer: str) -> int:
    """How many trailing characters might still become a marker, plus the newlines before them (the blank
    line before a tool-call block is not part of the text before it)."""
    keep = partial_marker(buffer, _MARKERS)
    last_tag = buffer.rfind(_TAG_START)
    if last_tag >= 0 and ">" not in buffer[last_tag:]:
        keep = max(keep, len(buffer) - last_tag)
    body = buffer[:len(buffer) - keep]
    return keep + len(body) - len(body.rstrip("\n"))


def _strip_block_gap(text: str) -> str:
    """Drop the blank line the format puts before a tool-call block (lenient: one or two newlines)."""
    for gap in ("\n\n", "\n"):
        if text.endswith(gap):
            return text[:-len(gap)]
    return text


def _invoke_name(tag: str) -> str:
    start = tag.find('name="')
    return tag[start + 6:tag.find('"', start + 6)] if start >= 0 else ""


def _first_stop(buffer: str, start: int) -> int:
    """Where an unclosed invoke ends: the next invoke, the block close, or EOS (-1 if none yet)."""
    stops = [m.start() for m in (INVOKE_OPEN_RE.search(buffer, start), CALLS_CLOSE_RE.search(buffer, start)) if m]
    if (eos := buffer.find(EOS, start)) >= 0:
        stops.append(eos)
    return min(stops, default=-1)
