"""An episode as its trace: one state per model turn, for the replay harvest.

State t is the conversation the model saw when it wrote turn t (the prompt and every turn before), action t is
what it wrote, and the error marker is the one the answers to turn t raised (a tool that failed, an environment
that said so, a call that could not be read), if any. The episode's reward is known only at its end, so it is
the last state's reward; the others have none (per-turn rewards are not known here). The seeds' design of trace
replay (research/wave4.md section 1) asks N teachers at each such state, so that a pair says which turn was the
mistake rather than which whole episode was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from composer_serverless.environments.episodes import Episode, ErrorSite


@dataclass(frozen=True)
class TraceStep:
    """One state of a trace: the conversation before turn ``turn``, what the model wrote there, and the error
    marker its answers raised."""

    turn: int
    state: list[dict[str, Any]]
    action: str
    error: ErrorSite | None


def turn_starts(model: list[bool]) -> list[int]:
    """Where each model turn starts in an episode's ``ids`` (the first token of each run of model tokens)."""
    return [i for i, by_model in enumerate(model) if by_model and (i == 0 or not model[i - 1])]


def trace(episode: Episode) -> list[TraceStep]:
    """The episode's states, one per turn it wrote (``Episode.states`` holds as many), in order.

    An error site sits at the first token after the tool turn that answered turn t, so it belongs to the last
    turn that started before it."""
    starts = turn_starts(episode.model)
    errors: dict[int, ErrorSite] = {}
    for site in episode.sites:
        turn = sum(start < site.position for start in starts) - 1
        errors.setdefault(turn, site)  # the first marker of a turn's answers, as SDPO's hint takes it
    steps = []
    turn = 0
    for index, message in enumerate(episode.messages):
        if message["role"] != "assistant":
            continue
        state = episode.prompt + episode.messages[:index]
        steps.append(TraceStep(turn, state, message["content"], errors.get(turn)))
        turn += 1
    return steps


def trace_rows(episode: Episode, reward: float, task: str) -> list[dict[str, Any]]:
    """The trace as the rows a harvest reads (``harvest.states``), less the ids the recorder gives them:
    ``{turn, prompt (the state's messages), student (the action), reward (on the last state only), error
    ({kind, hint} or null), tools, task}``; a turn with nothing written is no action to prefer another over
    and is left out."""
    steps = trace(episode)
    return [
        {
            "turn": step.turn,
            "prompt": step.state,
            "student": step.action,
            "reward": reward if step.turn == len(steps) - 1 else None,
            "error": None if step.error is None else {"kind": step.error.kind, "hint": step.error.hint},
            "tools": episode.tools,
            "task": task,
        }
        for step in steps
        if step.action.strip()
    ]


def transcript(messages: list[dict[str, Any]]) -> str:
    """An episode's turns as one readable text (the completions table's cell): each turn under its role, a
    tool's answer under the tool's name."""
    heads = [
        f"[tool {m['name']}]" if m["role"] == "tool" and "name" in m else f"[{m['role']}]" for m in messages
    ]
    return "\n".join(f"{head}\n{m['content']}" for head, m in zip(heads, messages, strict=True))
