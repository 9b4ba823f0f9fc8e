"""The episode loop: the model writes a turn, its tool calls are answered, until the episode ends.

An episode ends when the model answers without calling a tool, the environment says it is done, the model has
written ``max_turns`` turns, or the trajectory would pass ``max_tokens`` (a tool answer that would is not
appended, as TRL rolls it back). A turn cut by the per-turn token limit ends the episode too (truncated).

Generation is the caller's (``Complete``: the rollout engine continuing every live episode's tokens in one
batch), so any engine that completes token prefixes continues an episode. Tool calls of all episodes of a batch
run at once, each in a thread of its own, and a call not answered within ``tool_timeout_s`` ends its episode:
a slow tool costs one timeout per turn, never one per episode, and the replica never waits longer. An
environment that raises outside a tool (in ``reset``, ``get_reward``) or hangs ends its episode with reward 0,
counted in ``failed`` and logged; never the run. A tool that raises is answered with the error (TRL's
``{"error": ...}``) and marks an error site.

Tokens: the trajectory is the model's tokens of each turn (its EOS included) and the template's tokens of each
tool turn, rendered as TRL renders them (the chat template's text for the tool messages up to the next
assistant header); only the model's carry loss.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from composer_serverless.environments.parsing import Malformed, parse_tool_calls
from composer_serverless.environments.protocol import Environment, ErrorMark, Step, ToolCall

logger = logging.getLogger(__name__)

Complete = Callable[[list[list[int]], int], list[list[int]]]
"""(token prefixes, most new tokens) -> each prefix's new tokens, up to and including its first EOS."""


@dataclass(frozen=True)
class Limits:
    """When an episode ends, and how long a tool may take."""

    max_turns: int
    max_tokens: int
    turn_tokens: int
    tool_timeout_s: float


@dataclass(frozen=True)
class ErrorSite:
    """An answer marked as an error: ``position`` is the index in ``Episode.ids`` of the first token after
    that tool turn, where the hint goes in for the teacher."""

    position: int
    kind: str
    hint: str


@dataclass
class Episode:
    """One episode's trajectory and what happened in it.

    Attributes:
        prompt_ids: the rendered prompt (with the tools' schemas and any reset observation).
        ids: every token after the prompt: model turns and tool turns.
        model: per token of ``ids``, whether the model wrote it (only those carry loss).
        messages: the turns as TRL's conversational ``completions`` hold them (assistant, tool, ...).
        states: the conversation after each model turn and its answer, for a trace (one per turn).
        sites: the error sites, in order.
        failed: why the environment ended the episode (raised or hung), None when it did not.
        env_reward: the environment's own reward, None when it owns none (or failed).
        prompt: the prompt as messages (the first state of its trace).
        tools: the tools' JSON schemas the prompt was rendered with (a trace's states are rendered with them).
    """

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    model: list[bool] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    states: list[list[dict[str, Any]]] = field(default_factory=list)
    sites: list[ErrorSite] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    truncated: bool = False
    failed: str | None = None
    env_reward: float | None = None
    prompt: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)

    def extend(self, ids: Sequence[int], by_model: bool) -> None:
        self.ids += ids
        self.model += [by_model] * len(ids)


@dataclass(frozen=True)
class Codec:
    """How turns become text and tokens for one tokenizer."""

    decode: Callable[[list[int]], str]
    tool_turns: Callable[[list[dict[str, Any]]], list[int]]
    eos_ids: frozenset[int]


def chat_codec(tokenizer: Any, eos_ids: Sequence[int]) -> Codec:
    """The tokenizer's codec: tool turns rendered with its chat template exactly as TRL's
    ``_get_tool_suffix_ids`` does (the template's text after a finished assistant turn, up to and including
    the next assistant header)."""

    def tool_turns(messages: list[dict[str, Any]]) -> list[int]:
        calls = [{"type": "function", "function": {"name": messages[0]["name"], "arguments": {}}}]
        dummy = [
            {"role": "user", "content": "dummy"},
            {"role": "assistant", "content": "", "tool_calls": calls},
        ]
        prefix = tokenizer.apply_chat_template(dummy, tokenize=False, add_generation_prompt=False)
        full = tokenizer.apply_chat_template(dummy + messages, tokenize=False, add_generation_prompt=True)
        if not full.startswith(prefix):
            raise ValueError("the chat template renders a tool turn by changing the turns before it")
        return tokenizer(full[len(prefix) :], add_special_tokens=False)["input_ids"]

    return Codec(lambda ids: tokenizer.decode(ids, skip_special_tokens=True), tool_turns, frozenset(eos_ids))


def run_all(jobs: list[Callable[[], Any]], timeout_s: float) -> list[tuple[str, Any]]:
    """Each job in a daemon thread of its own, all at once; per job ``("ok", value)``, ``("raised", error)``
    or ``("timeout", None)`` when it was not done ``timeout_s`` after it started. A hung job's thread is left
    behind (a daemon: it never holds the process up)."""
    results: list[tuple[str, Any]] = [("timeout", None)] * len(jobs)

    def run(i: int, job: Callable[[], Any]) -> None:
        try:
            results[i] = ("ok", job())
        except Exception as e:
            results[i] = ("raised", e)

    threads = [threading.Thread(target=run, args=(i, job), daemon=True) for i, job in enumerate(jobs)]
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return [results[i] if not threads[i].is_alive() else ("timeout", None) for i in range(len(jobs))]


def _malformed(call: Malformed) -> Step:
    return Step(
        f'{{"error": "malformed tool call: {call.why}"}}',
        error=ErrorMark(
            "malformed_call", f"the tool call {call.text.strip()!r} could not be read: {call.why}"
        ),
    )


def _fail(episode: Episode, index: int, why: str) -> None:
    episode.failed = why
    logger.warning("episode %d ended by its environment: %s", index, why)


def run_episodes(
    complete: Complete,
    prompt_ids: Sequence[list[int]],
    environments: Sequence[Environment],
    codec: Codec,
    limits: Limits,
    prompts: Sequence[list[dict[str, Any]]] | None = None,
) -> list[Episode]:
    """Run one episode per prompt against its environment (already reset), all turns of all episodes batched.

    Args:
        complete: continues token prefixes (the rollout engine).
        prompt_ids: each episode's rendered prompt.
        environments: each episode's environment.
        codec: the tokenizer's turns (``chat_codec``).
        limits: when episodes end.
        prompts: each episode's prompt as messages, the start of its recorded states.
    """
    episodes = [Episode(list(p)) for p in prompt_ids]
    conversation = [list(p) for p in prompts] if prompts is not None else [[] for _ in episodes]
    live = list(range(len(episodes)))
    while live:
        budgets = [min(limits.turn_tokens, limits.max_tokens - len(episodes[i].ids)) for i in live]
        written = complete([episodes[i].prompt_ids + episodes[i].ids for i in live], max(budgets))
        asked: list[tuple[int, list[ToolCall | Malformed]]] = []
        for i, out, budget in zip(live, written, budgets, strict=True):
            episode, out = episodes[i], list(out[:budget])
            episode.extend(out, by_model=True)
            episode.turns += 1
            ended = bool(out) and out[-1] in codec.eos_ids
            text = codec.decode(out[:-1] if ended else out)
            calls = parse_tool_calls(text)
            episode.messages.append({"role": "assistant", "content": text})
            conversation[i].append({"role": "assistant", "content": text})
            if not ended or (calls and episode.turns >= limits.max_turns):
                episode.truncated = True
            if ended and calls and episode.turns < limits.max_turns:
                asked.append((i, calls))
            else:
                episode.states.append(list(conversation[i]))
        live = _answer(episodes, environments, asked, codec, limits, conversation)
    for i, (episode, environment) in enumerate(zip(episodes, environments, strict=True)):
        if episode.failed is None:
            outcome = run_all([environment.reward], limits.tool_timeout_s)[0]
            if outcome[0] == "ok":
                episode.env_reward = outcome[1]
            else:
                _fail(
                    episode,
                    i,
                    "its reward " + ("timed out" if outcome[0] == "timeout" else f"raised {outcome[1]!r}"),
                )
        run_all([environment.close], limits.tool_timeout_s)
    return episodes


def _answer(
    episodes: list[Episode],
    environments: Sequence[Environment],
    asked: list[tuple[int, list[ToolCall | Malformed]]],
    codec: Codec,
    limits: Limits,
    conversation: list[list[dict[str, Any]]],
) -> list[int]:
    """Answer the calls of every episode that made some, the n-th calls of all episodes at once; the episodes
    that go on."""
    steps: dict[int, list[tuple[str, Step]]] = {i: [] for i, _ in asked}
    broken: set[int] = set()
    depth = max((len(calls) for _, calls in asked), default=0)
    for n in range(depth):
        wave = [(i, calls[n]) for i, calls in asked if n < len(calls) and i not in broken]
        tools = [(i, c) for i, c in wave if isinstance(c, ToolCall)]
        outcomes = run_all(
            [lambda e=environments[i], c=c: e.step(c) for i, c in tools], limits.tool_timeout_s
        )
        for (i, call), (status, value) in zip(tools, outcomes, strict=True):
            if status == "ok":
                steps[i].append((call.name, value))
            else:
                broken.add(i)
                why = (
                    f"timed out after {limits.tool_timeout_s:g} s"
                    if status == "timeout"
                    else f"raised {value!r}"
                )
                _fail(episodes[i], i, f"tool {call.name!r} {why}")
        for i, call in wave:
            if isinstance(call, Malformed) and i not in broken:
                steps[i].append(("unknown", _malformed(call)))
    going = []
    for i, calls in asked:
        episode = episodes[i]
        episode.tool_calls += len(calls)
        if i in broken:
            episode.states.append(list(conversation[i]))
            continue
        ordered = steps[i]  # one call of an episode per wave: the answers are in the order of its calls
        messages = [{"role": "tool", "name": name, "content": step.observation} for name, step in ordered]
        suffix = codec.tool_turns(messages)
        if len(episode.ids) + len(suffix) >= limits.max_tokens:
            episode.truncated = True
            episode.states.append(list(conversation[i]))
            continue
        episode.extend(suffix, by_model=False)
        episode.messages += messages
        conversation[i] += messages
        episode.states.append(list(conversation[i]))
        for _, step in ordered:
            if step.error is not None:
                episode.tool_errors += 1
                episode.sites.append(ErrorSite(len(episode.ids), step.error.kind, step.error.hint))
        if not any(step.done for _, step in ordered):
            going.append(i)
    return going
