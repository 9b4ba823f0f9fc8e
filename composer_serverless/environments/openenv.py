"""OpenEnv environments: an environment server (``openenv-core``) the episodes act on through OpenEnv's own
client, one WebSocket session per episode (``GenericEnvClient``, used through its ``sync()`` wrapper).

The mapping is OpenEnv's own tool-calling contract, the MCP actions every ``MCPEnvironment`` answers:

- after ``reset``, the ``list_tools`` action lists the tools; each ``Tool(name, description, input_schema)`` is
  given to the chat template as the schema transformers builds for a function (``{"type": "function",
  "function": {"name", "description", "parameters": input_schema}}``);
- the model's call ``<tool_call>{"name": n, "arguments": a}</tool_call>`` is the action ``{"type": "call_tool",
  "tool_name": n, "arguments": a}``;
- the observation's result is the tool turn: the text of its MCP content (``result.content[].text``), or the
  result's value as JSON when it has none; a ``CallToolObservation.error`` (the tool raised, an unknown tool, bad
  arguments, a timeout: OpenEnv's ``ToolError``) or an MCP result with ``is_error`` is answered as
  ``{"error": message}`` and marks an error site whose hint is the message;
- the step's ``done`` ends the episode; the episode's environment reward is the sum of its steps' rewards (the
  undiscounted return: a reward given only at the end is that reward), None when the server gave none.

``reset(**row)`` is sent the dataset row (the server passes each environment the columns its ``reset`` names);
a non-empty reset observation is appended to the prompt's last turn (a lone text field as it is, else JSON).
A server that does not answer raises ``OpenEnvUnreachable``; a server error during an episode ends that
episode (the episode loop counts it as failed), never the run.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from composer_serverless.environments.protocol import ErrorMark, Step, ToolCall
from composer_serverless.environments.tools import EnvironmentConfigError

logger = logging.getLogger(__name__)

INSTALL = "pip install 'composer-serverless[openenv]'  (openenv-core)"
CONNECT_TIMEOUT_S = 5.0


class OpenEnvUnreachable(ConnectionError):
    """The OpenEnv server did not answer; the message says what was tried and how to fix it."""


def client_class() -> type:
    """OpenEnv's generic client (dict actions and observations), or the install line when it is missing."""
    try:
        from openenv.core import GenericEnvClient
    except ImportError as e:
        raise EnvironmentConfigError(
            f"composer.episodes.openenv_url needs the openenv-core package, which is not installed ({e})\n"
            f"  fix: {INSTALL}"
        ) from e
    return GenericEnvClient


def tool_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """An OpenEnv ``Tool`` as the chat template takes a tool (transformers' ``get_json_schema`` shape)."""
    function = {"name": tool["name"], "description": tool.get("description") or ""}
    return {"type": "function", "function": {**function, "parameters": tool.get("input_schema") or {}}}


def result_text(result: Any) -> str:
    """The tool turn's text of an MCP call result: its text content, else the result as JSON."""
    if isinstance(result, dict) and isinstance(result.get("content"), list):
        texts = [c["text"] for c in result["content"] if isinstance(c, dict) and c.get("type") == "text"]
        if texts:
            return "\n".join(texts)
        data = result.get("data")  # FastMCP's value of the call; its structured content wraps it
        result = data if data is not None else result.get("structured_content")
    return result if isinstance(result, str) else json.dumps(result, default=str)


def answer(observation: dict[str, Any], done: bool) -> Step:
    """Our ``Step`` for a ``CallToolObservation`` (as the generic client returns it, a dict)."""
    error = observation.get("error")
    result = observation.get("result")
    if error:
        kind = "unknown_tool" if error.get("error_type") == "tool_not_found" else "tool_error"
        message = str(error.get("message"))
        return Step(json.dumps({"error": message}), done, ErrorMark(kind, message))
    text = result_text(result)
    if isinstance(result, dict) and result.get("is_error"):
        return Step(json.dumps({"error": text}), done, ErrorMark("tool_error", text))
    return Step(text, done)


def reset_text(observation: dict[str, Any]) -> str | None:
    """What a reset observation adds to the prompt: nothing when empty, a lone text field as it is, else JSON."""
    values = [v for v in observation.values() if v not in (None, "", [], {})]
    if not values:
        return None
    if len(values) == 1 and isinstance(values[0], str):
        return values[0]
    return json.dumps(observation, default=str)


@dataclass
class OpenEnvEnvironment:
    """One episode's session on an OpenEnv server (the ``Environment`` protocol)."""

    url: str
    message_timeout_s: float
    tools: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._client: Any = None
        self._reward: float | None = None

    def reset(self, row: dict[str, Any]) -> str | None:
        client = client_class()(
            self.url, connect_timeout_s=CONNECT_TIMEOUT_S, message_timeout_s=self.message_timeout_s
        ).sync()
        try:
            client.connect()
        except ConnectionError as e:
            client.close()
            raise OpenEnvUnreachable(
                f"the OpenEnv server at {self.url} does not answer: {e}\n  fix: start the environment server "
                "(e.g. `uvicorn server.app:app --port 8000` in the environment's directory, or its container) "
                "and set composer.episodes.openenv_url to its address, reachable from every replica"
            ) from e
        self._client = client
        try:
            observation = client.reset(**json.loads(json.dumps(row, default=str))).observation
            listed = client.step({"type": "list_tools"}).observation
        except Exception:
            self.close()  # the episode never starts, so the loop will not close it
            raise
        self.tools = [tool_schema(t) for t in listed.get("tools") or []]
        return reset_text(observation)

    def step(self, call: ToolCall) -> Step:
        result = self._client.step({"type": "call_tool", "tool_name": call.name, "arguments": call.arguments})
        if result.reward is not None:
            self._reward = (self._reward or 0.0) + float(result.reward)
        return answer(result.observation, bool(result.done))

    def state(self) -> dict[str, Any]:
        return dict(self._client.state()) if self._client is not None else {}

    def reward(self) -> float | None:
        return self._reward

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


@dataclass(frozen=True)
class OpenEnvFactory:
    """A session on the OpenEnv server per episode; the server owns the reward."""

    url: str
    message_timeout_s: float
    owns_reward = True
    reward_name = "openenv"

    def __call__(self) -> OpenEnvEnvironment:
        return OpenEnvEnvironment(self.url, self.message_timeout_s)
