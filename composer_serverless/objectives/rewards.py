"""Verifiable rewards: each scores a completion of a prompt record and says what was wrong, for hints.

A reward returns a `Score`: a value and, when the completion fell short, feedback in words (the expected
answer, the pattern it should match, the first failing test). The value drives GRPO; the feedback becomes the
SDPO teacher's hint (see `hints`). A run sums the configured rewards with their weights (`RewardSet`).

Built in: `exact_match` (the record's `answer`, whitespace at either end ignored), `format` (a regex the whole
completion must match), `unit_tests` (the record's `tests` run against the completion's code in a sandboxed
subprocess, see `sandbox`; the value is the fraction that pass). A user reward is named by import path
`package.module:function` and called as `function(completion: str, record: PromptRecord)`, returning a number
or a `Score`.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from composer_serverless.config import RewardConfig
from composer_serverless.data.records import PromptRecord
from composer_serverless.objectives.sandbox import run_tests

# Sandboxed test runs wait on child processes, not on the GIL, so a few run side by side.
SANDBOX_WORKERS = 4


class RewardError(ValueError):
    """A reward cannot be resolved, cannot score a record, or returned something that is not a score."""


@dataclass(frozen=True)
class Score:
    """A reward's verdict on one completion: the value, and feedback in words when it fell short."""

    value: float
    feedback: str | None = None


# Scores a batch: completions[i] answers records[i].
BatchReward = Callable[[Sequence[str], Sequence[PromptRecord]], list[Score]]


def exact_match(completion: str, record: PromptRecord) -> Score:
    """1 if the completion is the record's answer (surrounding whitespace ignored), else 0 and the answer."""
    answer = _needed(record, "answer", "exact_match")
    if completion.strip() == answer.strip():
        return Score(1.0)
    return Score(0.0, f"The expected answer is {answer.strip()}.")


def format_reward(pattern: str) -> Callable[[str, PromptRecord], Score]:
    """A reward of 1 when the whole completion matches ``pattern`` (``re.fullmatch``), else 0."""
    compiled = re.compile(pattern)

    def matches(completion: str, record: PromptRecord) -> Score:
        if compiled.fullmatch(completion):
            return Score(1.0)
        return Score(0.0, f"The answer must match the pattern {pattern}.")

    return matches


def unit_tests(timeout_s: float) -> BatchReward:
    """The fraction of the record's tests that pass against the completion's code, run in the sandbox."""

    def one(completion: str, record: PromptRecord) -> Score:
        result = run_tests(completion, _needed(record, "tests", "unit_tests"), timeout_s=timeout_s)
        failure = result.first_failure()
        return Score(result.passed_fraction, None if failure is None else f"A test failed: {failure}")

    def batch(completions: Sequence[str], records: Sequence[PromptRecord]) -> list[Score]:
        with ThreadPoolExecutor(SANDBOX_WORKERS) as pool:
            return list(pool.map(one, completions, records))

    return batch


def load_user_reward(path: str) -> Callable[[str, PromptRecord], Any]:
    """The callable at ``package.module:function``.

    Raises:
        RewardError: the module does not import, has no such attribute, or the attribute is not callable.
    """
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise RewardError(f"reward {path!r}: expected an import path 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # whatever the import raised, the user's fix is the same: make it importable
        raise RewardError(
            f"reward {path!r}: cannot import {module_name!r} ({type(e).__name__}: {e}); install the package "
            "or put its directory on PYTHONPATH on every replica"
        ) from e
    fn = getattr(module, attribute, None)
    if fn is None:
        raise RewardError(f"reward {path!r}: module {module_name!r} has no attribute {attribute!r}")
    if not callable(fn):
        raise RewardError(f"reward {path!r}: {attribute!r} is a {type(fn).__name__}, not a function")
    return fn


def _needed(record: PromptRecord, field: str, reward: str) -> Any:
    value = getattr(record, field)
    if not value:
        raise RewardError(
            f"{record.source}: reward {reward} needs {field!r}, which this record does not have"
        )
    return value


def _as_score(value: Any, name: str) -> Score:
    if isinstance(value, Score):
        score = value
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        score = Score(float(value))
    else:
        raise RewardError(f"reward {name!r} returned {type(value).__name__}; return a float or a Score")
    if not math.isfinite(score.value):
        raise RewardError(f"reward {name!r} returned {score.value}; rewards must be finite")
    return score


def _per_item(fn: Callable[[str, PromptRecord], Any], name: str) -> BatchReward:
    def batch(completions: Sequence[str], records: Sequence[PromptRecord]) -> list[Score]:
        return [_as_score(fn(c, r), name) for c, r in zip(completions, records, strict=True)]

    return batch


@dataclass(frozen=True)
class Reward:
    """One configured reward: its name in metrics, its weight, the record field it needs, the scorer."""

    name: str
    weight: float
    needs: str | None
    score: BatchReward


def resolve(config: RewardConfig) -> Reward:
    """The reward a `RewardConfig` names; user rewards are imported here (raises `RewardError`)."""
    if config.fn == "exact_match":
        return Reward("exact_match", config.weight, "answer", _per_item(exact_match, "exact_match"))
    if config.fn == "format":
        assert config.pattern is not None  # the config validates this
        return Reward("format", config.weight, None, _per_item(format_reward(config.pattern), "format"))
    if config.fn == "unit_tests":
        return Reward("unit_tests", config.weight, "tests", unit_tests(config.timeout_s))
    return Reward(config.fn, config.weight, None, _per_item(load_user_reward(config.fn), config.fn))


@dataclass(frozen=True)
class Scored:
    """Rewards of a batch of completions.

    Attributes:
        totals: the weighted sum per completion.
        by_reward: each reward's values, by reward name.
        feedback: per completion, the feedback of every reward that gave some, one per line; None if none did.
    """

    totals: list[float]
    by_reward: dict[str, list[float]]
    feedback: list[str | None]


class RewardSet:
    """The run's rewards, summed with their weights."""

    def __init__(self, configs: Sequence[RewardConfig]) -> None:
        rewards = [resolve(c) for c in configs]
        names = [r.name for r in rewards]
        # Two rewards of one kind (two format patterns, say) get distinct metric names.
        self.rewards = [
            Reward(f"{r.name}#{i}", r.weight, r.needs, r.score) if names.count(r.name) > 1 else r
            for i, r in enumerate(rewards)
        ]

    def check(self, records: Sequence[PromptRecord]) -> None:
        """Raise `RewardError` naming the first record that lacks a field a reward needs."""
        for reward in self.rewards:
            if reward.needs is None:
                continue
            for record in records:
                _needed(record, reward.needs, reward.name)

    def score(self, completions: Sequence[str], records: Sequence[PromptRecord]) -> Scored:
        if len(completions) != len(records):
            raise ValueError(f"{len(completions)} completions for {len(records)} records")
        totals = [0.0] * len(completions)
        by_reward: dict[str, list[float]] = {}
        notes: list[list[str]] = [[] for _ in completions]
        for reward in self.rewards:
            scores = reward.score(completions, records)
            by_reward[reward.name] = [s.value for s in scores]
            for i, s in enumerate(scores):
                totals[i] += reward.weight * s.value
                if s.feedback:
                    notes[i].append(s.feedback)
        return Scored(totals, by_reward, ["\n".join(n) if n else None for n in notes])
