"""The states a harvest asks about: a prompt and what the student answered there.

They come from a trace file (JSON lines or Parquet through fsspec, as every record file of the project) or from
a run's store, where composer replicas that record their rollouts write one file per replica and round
(``layout.rollouts``). A row is ``{prompt, student, id?, reward?, task?}``; ``teachers`` (answers recorded
offline, as in the task suite's traces) and ``meta`` are allowed and not read: the harvest asks live ones.

A state of an episode's trace (``environments.traces``) has a conversation for its prompt (the messages the
model saw before its turn: tool answers included), the tools' schemas it was rendered with, and its
``episode``, ``turn`` and ``error`` marker; the teachers are asked to continue that conversation.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from typing import Any

from composer_serverless.data.records import Prompt, RecordError, conversation, json_lines, read_rows
from composer_serverless.harvest.conversation import openai_messages
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import ObjectStore

STATE_KEYS = (
    "id",
    "prompt",
    "student",
    "reward",
    "task",
    "teachers",
    "meta",
    "episode",
    "turn",
    "error",
    "tools",
)


@dataclass(frozen=True)
class State:
    """One step of a student's trace: the prompt (a text, or the conversation so far), the student's answer,
    and where it came from.

    Attributes:
        tools: the tools' JSON schemas the conversation was rendered with (a trace's state), else empty.
    """

    id: str
    prompt: Prompt
    student: str
    reward: float | None = None
    task: str | None = None
    tools: tuple[dict[str, Any], ...] = ()

    @property
    def key(self) -> str:
        """What the teachers are asked, as one string: states with the same key get the same answers."""
        if isinstance(self.prompt, str):
            return self.prompt
        return json.dumps([self.prompt, self.tools], sort_keys=True, ensure_ascii=False)


def state_of(row: dict[str, Any], where: str) -> State:
    """A state from one row; ``where`` (``file:line``) is its id when the row has none.

    Raises:
        RecordError: an unknown key, or a field of the wrong type.
    """
    unknown = [k for k in row if k not in STATE_KEYS]
    if unknown:
        raise RecordError(f"{where}: unknown key {unknown[0]!r}; a state has {', '.join(STATE_KEYS)}")
    if not isinstance(row.get("student"), str) or not row["student"]:
        raise RecordError(f"{where}: 'student' must be a non-empty string")
    prompt = conversation(row.get("prompt"), where)
    if not isinstance(prompt, str):
        try:
            openai_messages(prompt)  # what the teachers will be sent: refused here, not mid-harvest
        except ValueError as e:
            raise RecordError(f"{where}: 'prompt': {e}") from None
    tools = row.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise RecordError(f"{where}: 'tools' must be a list of JSON schemas (objects)")
    reward = row.get("reward")
    if reward is not None and (
        isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward)
    ):
        raise RecordError(f"{where}: 'reward' must be a finite number, got {json.dumps(reward)}")
    ident = row.get("id", where)
    if not isinstance(ident, (str, int)) or isinstance(ident, bool):
        raise RecordError(f"{where}: 'id' must be a string or an integer")
    task = row.get("task")
    if task is not None and not isinstance(task, str):
        raise RecordError(f"{where}: 'task' must be a string")
    return State(
        str(ident), prompt, row["student"], None if reward is None else float(reward), task, tuple(tools)
    )


def read_trace(url: str) -> list[State]:
    """Every state of the trace file(s) at ``url``, in file order (RecordError, FileNotFoundError)."""
    return [state_of(row, where) for row, where in read_rows(url)]


def latest_rollout_round(run: ObjectStore) -> int:
    """The newest round with recorded rollouts in ``run``; 0 when there is none."""
    rounds = [int(name) for name in run.list(layout.ROLLOUTS) if name.isdigit()]
    return max(rounds, default=0)


def rollout_ranks(run: ObjectStore, round_index: int) -> list[int]:
    names = run.list(layout.rollouts_dir(round_index))
    return sorted(int(n.removesuffix(".jsonl")) for n in names if n.removesuffix(".jsonl").isdigit())


def read_rollouts(run: ObjectStore, round_index: int, ranks: list[int] | None = None) -> list[State]:
    """The states of the rollouts of ``round_index`` of the replicas ``ranks`` (None: of every replica that
    recorded them), replica by replica."""
    states = []
    for rank in rollout_ranks(run, round_index) if ranks is None else ranks:
        key = layout.rollouts(round_index, rank)
        name = run.url_of(key)
        for number, row in json_lines(io.BytesIO(run.get(key)), name):
            states.append(state_of(row, f"{name}:{number}"))
    return states


def select_states(states: list[State], max_prompts: int | None) -> list[State]:
    """One state per distinct question (``State.key``) to ask about: the lowest mean reward first when the
    states carry rewards (the student's worst mistakes), else in order of first appearance; at most
    ``max_prompts``."""
    first: dict[str, State] = {}
    order: dict[str, list[float]] = {}
    for state in states:
        first.setdefault(state.key, state)
        order.setdefault(state.key, [])
        if state.reward is not None:
            order[state.key].append(state.reward)
    keys = list(order)
    if any(order.values()):
        position = {k: i for i, k in enumerate(keys)}

        def mean(key: str) -> float:
            rewards = order[key]
            return sum(rewards) / len(rewards) if rewards else math.inf

        keys.sort(key=lambda k: (mean(k), position[k]))
    return [first[k] for k in (keys if max_prompts is None else keys[:max_prompts])]
