"""Reading the tool calls in a model's turn.

The format is the one the Hermes/Qwen2.5 tool-calling chat templates teach the model (and TRL parses for them):
each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, as many as the turn has. It is the
format of the suite's tiny tokenizer too, which has no template of its own for tool calls. A call whose body is
not that JSON object is malformed: answered as an error and marked an error site.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass

from composer_serverless.environments.protocol import ToolCall

CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class Malformed:
    """A call that could not be read, and why."""

    text: str
    why: str


def parse_tool_calls(text: str) -> list[ToolCall | Malformed]:
    """Every call in ``text``, in order; none when the turn calls no tool (it answers)."""
    calls: list[ToolCall | Malformed] = []
    for body in CALL.findall(text):
        try:
            value = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(Malformed(body, f"the call is not JSON ({e.msg} at character {e.pos})"))
            continue
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            calls.append(Malformed(body, 'the call is not an object {"name": ..., "arguments": {...}}'))
            continue
        arguments = value.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            with contextlib.suppress(json.JSONDecodeError):
                arguments = json.loads(arguments)
        if not isinstance(arguments, dict):
            calls.append(Malformed(body, "the call's arguments are not an object"))
            continue
        calls.append(ToolCall(value["name"], arguments))
    return calls
