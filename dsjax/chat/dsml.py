"""DSML, the markup DeepSeek-V4 models write tool calls in, for both dialects.

V4 (`encoding_dsv4.py`) and V4.1 (`encoding/encoding.py`) differ only in tag names: V4.1 puts a space
before each name and calls the block ` calls` instead of `tool_calls`::

    V4:   <｜DSML｜tool_calls>  <｜DSML｜invoke name="f">  <｜DSML｜parameter name="p" string="true">v</｜DSML｜parameter>
    V4.1: <｜DSML｜ calls>      <｜DSML｜ invoke name="f"> <｜DSML｜ parameter name="p" string="true">v</｜DSML｜ parameter>

(each tag on its own line, closing tags `</｜DSML｜invoke>` and `</｜DSML｜tool_calls>` likewise).

`string="true"` values are raw text; `string="false"` values are JSON. This module renders calls and the
tool-schema prompt, and reads calls back leniently (either dialect, stray whitespace, missing attributes).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from dsjax.tokenizer import DSML, THINK_END, THINK_START


@dataclasses.dataclass(frozen=True)
class Dialect:
    """Tag names of one DSML dialect (the text between `<｜DSML｜` and `>`/` name=`)."""

    calls: str
    invoke: str
    parameter: str

    @property
    def calls_open(self) -> str:
        return f"<{DSML}{self.calls}>"

    @property
    def calls_close(self) -> str:
        return f"</{DSML}{self.calls}>"


V4_DIALECT = Dialect(calls="tool_calls", invoke="invoke", parameter="parameter")
V41_DIALECT = Dialect(calls=" calls", invoke=" invoke", parameter=" parameter")


def to_json(value: Any) -> str:
    """JSON the way the reference writes it: `", "` / `": "` separators, non-ASCII kept."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return json.dumps(value, ensure_ascii=True, default=str)


def tools_prompt(functions: list[dict], dialect: Dialect) -> str:
    """The `## Tools` section appended to a system (or V4 developer) message: DSML usage + one JSON line per tool."""
    d = dialect
    example = "\n".join([
        d.calls_open,
        f'<{DSML}{d.invoke} name="$TOOL_NAME">',
        f'<{DSML}{d.parameter} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}{d.parameter}>',
        "...",
        f"</{DSML}{d.invoke}>",
        f'<{DSML}{d.invoke} name="$TOOL_NAME2">',
        "...",
        f"</{DSML}{d.invoke}>",
        d.calls_close,
    ])
    schemas = "\n".join(to_json(f) for f in functions)
    return (
        "## Tools\n\n"
        "You have access to a set of tools to help answer the user's question. "
        f'You can invoke tools by writing a "{d.calls_open}" block like the following:\n\n'
        f"{example}\n\n"
        'String parameters should be specified as is and set `string="true"`. For all other types '
        '(numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
        f"If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside "
        f"{THINK_START}...{THINK_END} BEFORE any tool calls or final response.\n\n"
        f"Otherwise, output directly after {THINK_END} with tool calls or final response.\n\n"
        "### Available Tool Schemas\n\n"
        f"{schemas}\n\n"
        "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
    )


def arguments_as_dict(arguments: Any, *, unwrap_twice: bool) -> dict:
    """A tool call's arguments as a dict: a dict as is, a JSON object string decoded (V4.1 also decodes a
    double-encoded string); anything else is kept whole under the key "arguments", as the reference does."""
    value = arguments
    for _ in range(2 if unwrap_twice else 1):
        if not isinstance(value, str):
            break
        try:
            value = json.loads(value)
        except ValueError:
            break
    return value if isinstance(value, dict) else {"arguments": arguments}


def render_calls(calls: list[tuple[str, dict]], dialect: Dialect) -> str:
    """A DSML calls block for `[(name, arguments_dict), ...]` (no leading blank line)."""
    invokes = []
    for name, arguments in calls:
        params = "\n".join(
            f'<{DSML}{dialect.parameter} name="{key}" string="{"true" if isinstance(value, str) else "false"}">'
            f"{value if isinstance(value, str) else to_json(value)}</{DSML}{dialect.parameter}>"
            for key, value in arguments.items()
        )
        invokes.append(f'<{DSML}{dialect.invoke} name="{name}">\n{params}\n</{DSML}{dialect.invoke}>')
    return f"{dialect.calls_open}\n" + "\n".join(invokes) + f"\n{dialect.calls_close}"


# ---- reading calls back (lenient: either dialect, any whitespace inside tags) ----

_TAG = re.escape(DSML)
CALLS_OPEN_RE = re.compile(rf"<{_TAG}\s*(?:tool_calls|calls)\s*>")
CALLS_CLOSE_RE = re.compile(rf"</{_TAG}\s*(?:tool_calls|calls)\s*>")
INVOKE_OPEN_RE = re.compile(rf"<{_TAG}\s*invoke\b[^>]*>")
INVOKE_CLOSE_RE = re.compile(rf"</{_TAG}\s*invoke\s*>")
PARAMETER_RE = re.compile(
    rf"<{_TAG}\s*parameter\s+name=\"([^\"]*)\"(?:\s+string=\"(true|false)\")?\s*>(.*?)</{_TAG}\s*parameter\s*>",
    re.DOTALL,
)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One parsed call. `arguments` is a JSON object string, as OpenAI's API carries it."""

    name: str
    arguments: str
    index: int = 0

    def parsed_arguments(self) -> dict:
        return json.loads(self.arguments)

    def to_openai(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse_invoke(name: str, body: str, index: int) -> tuple[ToolCall, list[str]]:
    """One `invoke` body -> ToolCall plus notes on anything that had to be repaired.

    Like the reference, JSON (`string="false"`) values are copied verbatim into the arguments object; a value
    that is not valid JSON is kept as a string instead, with a note.
    """
    notes: list[str] = []
    fields: dict[str, str] = {}
    cursor = 0
    for match in PARAMETER_RE.finditer(body):
        if body[cursor:match.start()].strip():
            notes.append(f"tool call {name!r}: ignored text {body[cursor:match.start()].strip()[:80]!r}")
        cursor = match.end()
        key, string_flag, value = match.groups()
        if key in fields:
            notes.append(f"tool call {name!r}: duplicate parameter {key!r}, keeping the last")
        if string_flag is None:
            notes.append(f"tool call {name!r}: parameter {key!r} has no string attribute")
            string_flag = "false" if _is_json(value) else "true"
        if string_flag == "false" and not _is_json(value):
            notes.append(f"tool call {name!r}: parameter {key!r} is marked JSON but is not; kept as a string")
            string_flag = "true"
        fields[key] = to_json(value) if string_flag == "true" else value
    if body[cursor:].strip():
        notes.append(f"tool call {name!r}: ignored text {body[cursor:].strip()[:80]!r}")
    arguments = "{" + ", ".join(f"{to_json(k)}: {v}" for k, v in fields.items()) + "}"
    return ToolCall(name=name, arguments=arguments, index=index), notes


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
