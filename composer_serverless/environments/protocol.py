"""The environment contract an episode runs against, OpenEnv's shape (reset, step, state, close) with TRL's
content: a tool call is the action, the tool's answer the observation.

An answer is an error site when the call could not be made (malformed, an unknown tool), the tool raised, or
the tool said so by returning ``{"error": ..., "hint": ...}`` (the hint key names what the SDPO teacher is
told at that turn; without it the error text is the hint).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote: the tool's name and its arguments (already parsed from JSON)."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ErrorMark:
    """Why an answer is an error site, and what the teacher is told there."""

    # "malformed_call", "unknown_tool", "tool_raised" or "tool_error"; the built-in code environment's
    # "bad_arguments", "code_raised" or "code_timeout"
    kind: str
    hint: str


@dataclass(frozen=True)
class Step:
    """The environment's answer to one action.

    Attributes:
        observation: the tool turn's content.
        done: the environment ended the episode.
        error: set where the answer is an error site.
    """

    observation: str
    done: bool = False
    error: ErrorMark | None = None


def unknown_tool(name: str, known: Iterable[str]) -> Step:
    """The answer to a call of a tool the environment does not have (TRL's words), an error site."""
    return Step(
        json.dumps({"error": f"Tool {name} not found."}),
        error=ErrorMark("unknown_tool", f"there is no tool {name!r}; the tools are {', '.join(known)}"),
    )


class Environment(Protocol):
    """One episode's environment (a fresh one per episode)."""

    tools: list[dict[str, Any]]
    """The JSON schemas of the tools, as the chat template renders them (``tools=``)."""

    def reset(self, row: dict[str, Any]) -> str | None:
        """Start the episode on a dataset row; the text appended to the prompt's last turn, or None."""
        ...

    def step(self, call: ToolCall) -> Step:
        """Answer one tool call."""
        ...

    def state(self) -> dict[str, Any]:
        """What the environment holds now (after the last step), for a trace."""
        ...

    def reward(self) -> float | None:
        """The environment's own reward for the episode, None when it owns none."""
        ...

    def close(self) -> None: ...


class Factory(Protocol):
    """Builds one environment per episode (the user's class and tools, or a built-in)."""

    @property
    def owns_reward(self) -> bool:
        """The environments give a reward of their own (``Environment.reward``)."""
        ...

    @property
    def reward_name(self) -> str:
        """The name of that reward in metrics (``rollout/reward/NAME``)."""
        ...

    def __call__(self) -> Environment: ...
