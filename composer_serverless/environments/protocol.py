"""The environment contract an episode runs against, OpenEnv's shape (reset, step, state, close) with TRL's
content: a tool call is the action, the tool's answer the observation.

An answer is an error site when the call could not be made (malformed, an unknown tool), the tool raised, or
the tool said so by returning ``{"error": ..., "hint": ...}`` (the hint key names what the SDPO teacher is
told at that turn; without it the error text is the hint).
"""

from __future__ import annotations

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

    kind: str  # "malformed_call", "unknown_tool", "tool_raised" or "tool_error"
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


class EnvironmentSource(Protocol):
    """Makes one environment per episode (``tools.EnvironmentFactory``, ``openenv.OpenEnvFactory``)."""

    @property
    def owns_reward(self) -> bool:
        """Whether the environments give a reward of their own (summed into the episode's reward)."""
        ...

    @property
    def reward_name(self) -> str:
        """The name the environment's reward is logged under (``rollout/reward/<name>``)."""
        ...

    def __call__(self) -> Environment: ...
