"""Tool calls written in a chat model's own format (SmolLM2, Qwen2.5, Hermes):

    <tool_call>{"name": "calculator", "arguments": {"expression": "47*38"}}</tool_call>

``parse_tool_call(turn, tools)`` is a pure function: a turn without a call is the model's answer
(``None``); a well-formed call is a ``ToolCall``; anything else is a ``Malformed`` with the
reason, which the environment shows the model as its observation (and counts), never raises.
``tools`` maps each tool's name to the names of its required arguments.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Malformed:
    reason: str  # what was wrong, in words the model reads back


def parse_tool_call(turn: str, tools: Mapping[str, tuple[str, ...]]) -> ToolCall | Malformed | None:
    """The call the turn makes (the first one), ``Malformed`` if it tries and fails, ``None``
    if it makes none. Text before ``<tool_call>`` is allowed (the model may think first)."""
    start, close = turn.find(OPEN), turn.find(CLOSE)
    if start < 0 and close < 0:
        return None
    if close < 0:
        return Malformed(f"no closing {CLOSE}")
    if start < 0 or close < start:
        return Malformed(f"{CLOSE} without {OPEN} before it")
    body = turn[start + len(OPEN) : close].strip()
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return Malformed(f"the call is not JSON ({e.msg} at character {e.pos})")
    if not isinstance(call, dict):
        return Malformed('the call must be a JSON object {"name": ..., "arguments": {...}}')
    name, arguments = call.get("name"), call.get("arguments", {})
    if not isinstance(name, str):
        return Malformed('the call has no "name"')
    if name not in tools:
        return Malformed(f"unknown tool {name!r} (tools: {', '.join(sorted(tools))})")
    if not isinstance(arguments, dict):
        return Malformed('"arguments" must be a JSON object')
    missing = [a for a in tools[name] if a not in arguments]
    if missing:
        return Malformed(f"{name} needs the argument {missing[0]!r}")
    return ToolCall(name, arguments)


def format_tool_call(name: str, arguments: Mapping[str, Any]) -> str:
    """The call as the model writes it (demonstrations; ``json.dumps``' default spacing)."""
    return f"{OPEN}{json.dumps({'name': name, 'arguments': dict(arguments)})}{CLOSE}"
