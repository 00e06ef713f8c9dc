"""DeepSeek-V4 chat encoding: OpenAI-style messages -> the prompt string the model was trained on.

Behaviour follows DeepSeek's `encoding/encoding_dsv4.py` (V4-Flash / V4-Pro checkpoints, MIT) and is checked
against its official test vectors in `tests/data/encoding/`. The code is our own; `V4Encoder` is written
with small hooks so that `encoding_v41.V41Encoder` can change only what V4.1 changes.

The format, in short (no Jinja template exists)::

    <BOS>{system}[\\n\\n## Tools ...]<｜User｜>{user}<｜Assistant｜>{</think> or <think>}{reasoning</think>}{answer}<EOS>...

- chat mode (thinking off): each assistant header ends `</think>`; reasoning is never rendered.
- thinking mode: the header after the *last* user turn ends `<think>`; reasoning of earlier assistant turns
  is dropped (their header ends `</think>`), unless any message carries tools, then everything is kept.
- tool results are merged into a user turn as `<tool_result>…</tool_result>` blocks, in call order.
- `reasoning_effort="max"` (thinking mode) prepends a fixed paragraph; "high" and None add nothing.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from dsjax.chat.dsml import V4_DIALECT, Dialect, arguments_as_dict, render_calls, to_json, tools_prompt
from dsjax.errors import DsjaxError
from dsjax.tokenizer import (ASSISTANT, BOS, EOS, IMAGE, LATEST_REMINDER, TASK_TOKENS, THINK_END, THINK_START,
                             USER)


class ChatEncodingError(DsjaxError, ValueError):
    """A message list cannot be encoded: unknown role, malformed tool schema or call, bad option."""


REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)
RESPONSE_FORMAT_PREFIX = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
IMAGE_PART_TYPES = ("image_url", "image", "input_image")


@dataclasses.dataclass
class Turn:
    """One message after validation. User turns carry `blocks`: ("text", text) or ("tool_result", text, call_id)."""

    role: str
    content: str = ""
    reasoning: str | None = None
    tools: list[dict] | None = None  # function schemas (the "function" member of each OpenAI tool)
    response_format: Any = None
    tool_calls: list[tuple[str, dict, str]] = dataclasses.field(default_factory=list)  # (name, arguments, id)
    blocks: list[tuple] | None = None
    task: str | None = None
    wo_eos: bool = False


class V4Encoder:
    """Renders messages for DeepSeek-V4. Subclasses override the hooks marked "V4.1 changes this"."""

    family = "v4"
    dialect: Dialect = V4_DIALECT
    roles = ("system", "developer", "user", "assistant", "tool", "latest_reminder")
    user_turn_keeps_metadata = False  # V4 keeps only content/task/wo_eos of a user message when merging
    unwrap_arguments_twice = False
    allows_images = False

    def encode(self, messages: list[dict], *, thinking: bool, reasoning_effort: Any = None, tools: Any = None,
               drop_thinking: bool = True, add_generation_prompt: bool = True, add_bos: bool = True) -> str:
        self.check_reasoning_effort(reasoning_effort)
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ChatEncodingError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        turns = [self.read_message(i, m) for i, m in enumerate(messages)]
        if tools:
            self.attach_request_tools(turns, read_tools(tools, "tools"))
        turns = sort_tool_results(self.merge_tool_results(turns))
        drop = drop_thinking and not any(t.tools for t in turns)
        if thinking and drop:
            turns = self.drop_old_reasoning(turns)
        out = BOS if add_bos else ""
        for index in range(len(turns)):
            out += self.render(index, turns, thinking, drop, reasoning_effort,
                               header=add_generation_prompt or index < len(turns) - 1)
        return out

    # ---- validation: messages in, Turns out ----

    def check_reasoning_effort(self, effort: Any) -> None:
        """V4.1 changes this (numeric effort)."""
        if effort not in (None, "high", "max"):
            raise ChatEncodingError(f"reasoning_effort {effort!r} is not valid for DeepSeek-V4: "
                                    "use None, 'high' or 'max'")

    def read_message(self, index: int, message: Any) -> Turn:
        where = f"messages[{index}]"
        if not isinstance(message, dict) or "role" not in message:
            raise ChatEncodingError(f"{where} must be a dict with a 'role', got {message!r:.80}")
        role = message["role"]
        if role not in self.roles:
            raise ChatEncodingError(f"{where}: unknown role {role!r} for DeepSeek-{self.family.upper()}; "
                                    f"expected one of {', '.join(self.roles)}")
        turn = Turn(role=role, content=self.content_text(message.get("content"), where),
                    response_format=message.get("response_format"), wo_eos=bool(message.get("wo_eos", False)))
        reasoning = message.get("reasoning_content", message.get("reasoning"))
        if reasoning is not None and not isinstance(reasoning, str):
            raise ChatEncodingError(f"{where}: reasoning_content must be a string, got {type(reasoning).__name__}")
        turn.reasoning = reasoning
        if message.get("tools"):
            turn.tools = read_tools(message["tools"], f"{where}.tools")
        if message.get("tool_calls"):
            turn.tool_calls = self.read_tool_calls(message["tool_calls"], where)
        task = message.get("task")
        if task is not None and task not in TASK_TOKENS:
            raise ChatEncodingError(f"{where}: unknown task {task!r}; expected one of {', '.join(TASK_TOKENS)}")
        turn.task = task
        if role == "developer" and not turn.content:
            raise ChatEncodingError(f"{where}: a developer message needs non-empty content")
        if role == "tool":
            turn.blocks = [("tool_result", turn.content, str(message.get("tool_call_id") or ""))]
        return turn

    def content_text(self, content: Any, where: str) -> str:
        """A message's content as text: a string, None, or a list of OpenAI content parts joined by a blank line."""
        if content is None:
            return ""
        if isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise ChatEncodingError(f"{where}: content must be a string or a list of parts, "
                                    f"got {type(content).__name__}")
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                if self.allows_images and IMAGE in (part.get("text") or ""):
                    raise ChatEncodingError(f"{where}: a text part contains the image token {IMAGE!r}; "
                                            "pass images as {'type': 'image_url', ...} parts instead")
                parts.append(part.get("text") or "")
            elif kind in IMAGE_PART_TYPES and self.allows_images:
                parts.append(IMAGE)
            elif kind in IMAGE_PART_TYPES:
                raise ChatEncodingError(f"{where}: DeepSeek-{self.family.upper()} takes no images (V4.1 does)")
            else:
                raise ChatEncodingError(f"{where}: unsupported content part {part!r:.80}; expected type 'text'")
        return "\n\n".join(parts)

    def read_tool_calls(self, tool_calls: Any, where: str) -> list[tuple[str, dict, str]]:
        if not isinstance(tool_calls, list):
            raise ChatEncodingError(f"{where}.tool_calls must be a list of OpenAI tool calls")
        calls = []
        for i, call in enumerate(tool_calls):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ChatEncodingError(f"{where}.tool_calls[{i}] must look like "
                                        "{'type': 'function', 'function': {'name': str, 'arguments': str}}")
            arguments = arguments_as_dict(function.get("arguments", "{}"), unwrap_twice=self.unwrap_arguments_twice)
            calls.append((function["name"], arguments, str(call.get("id") or function.get("id") or "")))
        return calls

    # ---- preprocessing ----

    def attach_request_tools(self, turns: list[Turn], functions: list[dict]) -> None:
        """Request-level tools go on the leading system/developer message, else on a new empty system message
        (as vLLM's deepseek_v4 tokenizer does). V4.1 changes this."""
        if turns[0].role in ("system", "developer"):
            turns[0].tools = functions
        else:
            turns.insert(0, Turn(role="system", tools=functions))

    def merge_tool_results(self, turns: list[Turn]) -> list[Turn]:
        """V4 has no tool role: tool results join the preceding user turn, and consecutive user messages merge."""
        merged: list[Turn] = []
        for turn in turns:
            previous = merged[-1] if merged and merged[-1].role == "user" else None
            if turn.role == "tool":
                if previous is not None:
                    previous.blocks.extend(turn.blocks)
                else:
                    merged.append(Turn(role="user", blocks=list(turn.blocks)))
            elif turn.role == "user":
                if previous is not None and previous.task is None:
                    previous.blocks.append(("text", turn.content))
                    continue
                new = copy.copy(turn) if self.user_turn_keeps_metadata else Turn(
                    role="user", content=turn.content, task=turn.task, wo_eos=turn.wo_eos)
                new.blocks = [("text", turn.content)]
                merged.append(new)
            else:
                merged.append(turn)
        return merged

    def last_user_index(self, turns: list[Turn]) -> int:
        """Index of the turn after which the model answers. V4.1 changes this (mid-conversation system)."""
        return max((i for i, t in enumerate(turns) if t.role in ("user", "developer")), default=-1)

    def opens_assistant_turn(self, index: int, turn: Turn) -> bool:
        """Whether the assistant header follows this turn. V4.1 changes this."""
        return turn.role in ("user", "developer")

    def drop_old_reasoning(self, turns: list[Turn]) -> list[Turn]:
        """Before the last user turn: strip assistants' reasoning and drop developer messages."""
        last_user = self.last_user_index(turns)
        kept = []
        for i, turn in enumerate(turns):
            if i >= last_user or turn.role in ("user", "system", "latest_reminder"):
                kept.append(turn)
            elif turn.role == "assistant":
                kept.append(dataclasses.replace(turn, reasoning=None))
        return kept

    # ---- rendering ----

    def prefix(self, index: int, turn: Turn, thinking: bool, effort: Any) -> str:
        """Text before the first message. V4.1 changes this."""
        return REASONING_EFFORT_MAX if index == 0 and thinking and effort == "max" else ""

    def render_system(self, index: int, turn: Turn) -> str:
        return turn.content + self.tools_and_format(turn)

    def tools_and_format(self, turn: Turn) -> str:
        out = "\n\n" + tools_prompt(turn.tools, self.dialect) if turn.tools else ""
        if turn.response_format:
            out += "\n\n" + RESPONSE_FORMAT_PREFIX + to_json(turn.response_format)
        return out

    def render(self, index: int, turns: list[Turn], thinking: bool, drop: bool, effort: Any, header: bool) -> str:
        turn = turns[index]
        last_user = self.last_user_index(turns)
        out = self.prefix(index, turn, thinking, effort)
        if turn.role == "system":
            out += self.render_system(index, turn)
        elif turn.role == "developer":
            out += USER + turn.content + self.tools_and_format(turn)
        elif turn.role == "user":
            out += USER + "\n\n".join(
                b[1] if b[0] == "text" else f"<tool_result>{b[1]}</tool_result>" for b in turn.blocks)
        elif turn.role == "latest_reminder":
            out += LATEST_REMINDER + turn.content
        elif turn.role == "assistant":
            out += self.render_assistant(index, turns, thinking, drop, last_user)

        following = turns[index + 1].role if index + 1 < len(turns) else None
        if following not in (None, "assistant", "latest_reminder"):
            return out
        if turn.task == "action":
            out += ASSISTANT + (THINK_START if thinking else THINK_END) + TASK_TOKENS["action"]
        elif turn.task is not None:
            out += TASK_TOKENS[turn.task]
        elif header and self.opens_assistant_turn(index, turn):
            answering = not drop or index >= last_user
            out += ASSISTANT + (THINK_START if thinking and answering else THINK_END)
        return out

    def render_assistant(self, index: int, turns: list[Turn], thinking: bool, drop: bool, last_user: int) -> str:
        turn = turns[index]
        calls = "\n\n" + render_calls([(n, a) for n, a, _ in turn.tool_calls], self.dialect) if turn.tool_calls else ""
        after_task = index > 0 and turns[index - 1].task is not None
        reasoning = ""
        if thinking and not after_task and (not drop or index > last_user):
            reasoning = (turn.reasoning or "") + THINK_END
        return reasoning + turn.content + calls + ("" if turn.wo_eos else EOS)


def read_tools(tools: Any, where: str) -> list[dict]:
    """Validate OpenAI-format tools and return their function schemas."""
    if not isinstance(tools, list):
        raise ChatEncodingError(f"{where} must be a list of {{'type': 'function', 'function': {{...}}}} tools")
    functions = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ChatEncodingError(f"{where}[{i}] is not an OpenAI tool: expected {{'type': 'function', "
                                    f"'function': {{'name': str, 'parameters': {{...}}}}}}, got {tool!r:.120}")
        if "parameters" in function and not isinstance(function["parameters"], dict):
            raise ChatEncodingError(f"{where}[{i}] ({function['name']}): 'parameters' must be a JSON-schema object")
        functions.append(function)
    return functions


def sort_tool_results(turns: list[Turn]) -> list[Turn]:
    """Reorder the tool results inside each user turn to the order of the preceding assistant's calls."""
    order: dict[str, int] = {}
    for turn in turns:
        if turn.role == "assistant" and turn.tool_calls:
            order = {call_id: i for i, (_, _, call_id) in enumerate(turn.tool_calls) if call_id}
        elif turn.role == "user" and order:
            results = [b for b in turn.blocks if b[0] == "tool_result"]
            if len(results) > 1:
                ranked = iter(sorted(results, key=lambda b: order.get(b[2], 0)))
                turn.blocks = [next(ranked) if b[0] == "tool_result" else b for b in turn.blocks]
    return turns


def encode_v4(messages: list[dict], *, thinking: bool, reasoning_effort: Any = None, tools: Any = None,
              drop_thinking: bool = True, add_generation_prompt: bool = True, add_bos: bool = True) -> str:
    """Prompt string for DeepSeek-V4 (see module docstring)."""
    return V4Encoder().encode(messages, thinking=thinking, reasoning_effort=reasoning_effort, tools=tools,
                              drop_thinking=drop_thinking, add_generation_prompt=add_generation_prompt,
                              add_bos=add_bos)
