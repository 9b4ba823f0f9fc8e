"""A trace's state as the messages an OpenAI-compatible teacher is sent.

A state holds the conversation as the student's chat template saw it: assistant turns whose tool calls are
text (``<tool_call>{...}</tool_call>``) and tool turns named by their tool. The chat completions API takes tool
calls as structure instead: an assistant message carries ``tool_calls`` (each with an id), and each tool
message answers one of them by ``tool_call_id``, in order; servers (OpenAI's, vLLM's) refuse a tool message
that answers no call. So each assistant turn's calls are read as the episode loop read them
(``environments.parsing``) and given ids, and its tool answers take them in order; a call that could not be
read is sent as a call of the tool ``unknown`` with its text as arguments, as the loop answered it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from composer_serverless.environments.parsing import Malformed, parse_tool_calls


def openai_messages(conversation: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with its tool calls structured and its tool answers matched to them by id."""
    out: list[dict[str, Any]] = []
    pending: list[str] = []
    for turn, message in enumerate(conversation):
        if message["role"] == "assistant":
            calls = parse_tool_calls(message["content"])
            sent: dict[str, Any] = {"role": "assistant", "content": message["content"]}
            if calls:
                ids = [f"call_{turn}_{n}" for n in range(len(calls))]
                sent["tool_calls"] = [
                    {
                        "id": ident,
                        "type": "function",
                        "function": {"name": "unknown", "arguments": call.text}
                        if isinstance(call, Malformed)
                        else {"name": call.name, "arguments": json.dumps(call.arguments, sort_keys=True)},
                    }
                    for ident, call in zip(ids, calls, strict=True)
                ]
                pending = ids
            out.append(sent)
        elif message["role"] == "tool":
            if not pending:
                raise ValueError(f"message {turn} is a tool's answer to no tool call")
            out.append({"role": "tool", "tool_call_id": pending.pop(0), "content": message["content"]})
        else:
            out.append({"role": message["role"], "content": message["content"]})
    return out
