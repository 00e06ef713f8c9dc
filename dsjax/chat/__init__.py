"""Chat format of DeepSeek-V4 / V4.1: messages -> prompt, and generated text -> reasoning / content / tool calls.

    prompt = encode_messages(messages, family="v4.1", thinking=True, tools=tools)
    ids = encode_messages_to_ids(messages, family="v4.1", thinking=True)
    parser = OutputParser("v4.1", thinking=True)
    for delta in stream: events = parser.feed(delta)
    events = parser.flush(); result = parser.finish()   # ParsedOutput(reasoning, content, tool_calls, errors, ended)

See docs/tokenizer.md for the format and where each rule comes from.
"""

from __future__ import annotations

from typing import Any

from dsjax.chat.dsml import ToolCall
from dsjax.chat.encoding_v4 import ChatEncodingError, V4Encoder
from dsjax.chat.encoding_v41 import V41Encoder
from dsjax.chat.parsing import Event, OutputParser, ParsedOutput, parse_output
from dsjax.tokenizer import Tokenizer, check_family, load_tokenizer

__all__ = ["ChatEncodingError", "Event", "OutputParser", "ParsedOutput", "ToolCall", "encode_messages",
           "encode_messages_to_ids", "parse_output"]

_ENCODERS = {"v4": V4Encoder, "v4.1": V41Encoder}


def encode_messages(messages: list[dict], *, family: str, thinking: bool, reasoning_effort: Any = None,
                    tools: list[dict] | None = None, add_generation_prompt: bool = True, drop_thinking: bool = True,
                    add_bos: bool = True) -> str:
    """The prompt string for `messages` (OpenAI chat format) as DeepSeek's reference encoder writes it.

    thinking: True -> the prompt ends `<｜Assistant｜><think>`; False ("chat" mode) -> `<｜Assistant｜></think>`.
    reasoning_effort: V4: None | "high" | "max" (only "max" adds text). V4.1: None (= "high" = 75) | "low" |
        "high" | "max" | int in [1, 100]; rendered only when thinking.
    tools: OpenAI tools, attached to the leading system message (one is created if needed).
    add_generation_prompt: False leaves off the trailing assistant header.
    drop_thinking: drop reasoning of assistant turns before the last user turn (the reference default;
        ignored when any message carries tools).
    """
    check_family(family)
    return _ENCODERS[family]().encode(messages, thinking=thinking, reasoning_effort=reasoning_effort, tools=tools,
                                      drop_thinking=drop_thinking, add_generation_prompt=add_generation_prompt,
                                      add_bos=add_bos)


def encode_messages_to_ids(messages: list[dict], *, family: str, thinking: bool, tokenizer: Tokenizer | None = None,
                           **options: Any) -> list[int]:
    """Token ids of `encode_messages(...)`, with the family's tokenizer unless one is given."""
    tokenizer = tokenizer or load_tokenizer(check_family(family))
    if tokenizer.family != family:
        raise ValueError(f"tokenizer is for {tokenizer.family!r} but family={family!r}")
    return tokenizer.encode(encode_messages(messages, family=family, thinking=thinking, **options))
