"""DeepSeek-V4.1 chat encoding: V4's format with the changes of DeepSeek's V4.1 `encoding/encoding.py`.

Read from the copy of that file in `thedracle/deepseek-v41-mlx` (`docs/reference/encoding.py`); the code is
our own. What V4.1 changes relative to `encoding_v4`:

- `<｜System｜>` (id 128799) opens the prompt when the first message is a system message or a reasoning-effort
  line is rendered; a system message later in the conversation is written `<｜System｜>{text}` and is followed
  by the assistant header like a user turn.
- Reasoning effort is a number 1-100 (`"low"`=50, `"high"`=75 (default), `"max"`=100), written only in
  thinking mode: `Reasoning Effort: 75 (range 1-100, the higher the value, the more thorough the reasoning)`.
- DSML tag names carry a leading space (`<｜DSML｜ calls>`, see `dsml.V41_DIALECT`).
- Image content parts become `<｜deepseek_image｜>` (id 129264); the pixels themselves are out of scope here.
- No `developer` role; a user message keeps its metadata when tool results are merged into it.
"""

from __future__ import annotations

from typing import Any

from dsjax.chat.dsml import V41_DIALECT
from dsjax.chat.encoding_v4 import ChatEncodingError, Turn, V4Encoder
from dsjax.tokenizer import IMAGE, SYSTEM

REASONING_EFFORT_LEVELS = {"low": 50, "high": 75, "max": 100}
DEFAULT_REASONING_EFFORT = "high"


def reasoning_effort_line(effort: Any) -> str:
    """The V4.1 effort line for a level name or an int in [1, 100] (None = the default, "high" = 75)."""
    effort = DEFAULT_REASONING_EFFORT if effort is None else effort
    budget = REASONING_EFFORT_LEVELS.get(effort) if isinstance(effort, str) else effort
    return f"Reasoning Effort: {budget} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"


class V41Encoder(V4Encoder):
    family = "v4.1"
    dialect = V41_DIALECT
    roles = ("system", "user", "assistant", "tool", "latest_reminder")
    user_turn_keeps_metadata = True
    unwrap_arguments_twice = True
    allows_images = True

    def check_reasoning_effort(self, effort: Any) -> None:
        numeric = type(effort) is int and 1 <= effort <= 100
        if not (effort is None or numeric or (isinstance(effort, str) and effort in REASONING_EFFORT_LEVELS)):
            raise ChatEncodingError(f"reasoning_effort {effort!r} is not valid for DeepSeek-V4.1: use None, "
                                    f"{', '.join(map(repr, REASONING_EFFORT_LEVELS))} or an int in [1, 100]")

    def read_message(self, index: int, message: Any) -> Turn:
        if isinstance(message, dict) and message.get("role") == "developer":
            raise ChatEncodingError(f"messages[{index}]: DeepSeek-V4.1 has no 'developer' role; use 'system' "
                                    "(a system message may appear anywhere in the conversation)")
        turn = super().read_message(index, message)
        for field in ("content", "reasoning_content", "reasoning"):
            if isinstance(message.get(field), str) and IMAGE in message[field]:
                raise ChatEncodingError(f"messages[{index}].{field} contains the image token {IMAGE!r}; "
                                        "pass images as {'type': 'image_url', ...} content parts instead")
        return turn

    def attach_request_tools(self, turns: list[Turn], functions: list[dict]) -> None:
        """Request-level tools go on the first system message, wherever it is (as vLLM's deepseek_v41 does)."""
        system = next((t for t in turns if t.role == "system"), None)
        if system is None:
            turns.insert(0, Turn(role="system", tools=functions))
        else:
            system.tools = functions

    def last_user_index(self, turns: list[Turn]) -> int:
        return max((i for i, t in enumerate(turns) if t.role == "user" or (t.role == "system" and i > 0)),
                   default=-1)

    def opens_assistant_turn(self, index: int, turn: Turn) -> bool:
        return turn.role == "user" or (turn.role == "system" and index > 0)

    def prefix(self, index: int, turn: Turn, thinking: bool, effort: Any) -> str:
        if index != 0:
            return ""
        effort_text = reasoning_effort_line(effort) if thinking else ""
        return (SYSTEM if effort_text or turn.role == "system" else "") + effort_text

    def render_system(self, index: int, turn: Turn) -> str:
        return (SYSTEM if index > 0 else "") + super().render_system(index, turn)


def encode_v41(messages: list[dict], *, thinking: bool, reasoning_effort: Any = None, tools: Any = None,
               drop_thinking: bool = True, add_generation_prompt: bool = True, add_bos: bool = True) -> str:
    """Prompt string for DeepSeek-V4.1 (see module docstring)."""
    return V41Encoder().encode(messages, thinking=thinking, reasoning_effort=reasoning_effort, tools=tools,
                               drop_thinking=drop_thinking, add_generation_prompt=add_generation_prompt,
                               add_bos=add_bos)
