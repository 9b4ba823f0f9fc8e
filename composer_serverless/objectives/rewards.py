"""Verifiable rewards, written as TRL writes them, each saying what was wrong when it can (SDPO's hints).

A reward is ``fn(prompts, completions, completion_ids, **columns) -> list[float | None]``, called on a batch
as TRL's ``GRPOTrainer`` calls its ``reward_funcs``: ``prompts[i]`` is row i's prompt (a string, or its
conversation), ``completions[i]`` the sampled completion (a string; for a conversational prompt
``[{"role": "assistant", "content": text}]``; an episode's is its turns, assistant and tool messages, as TRL
passes them with tools), ``completion_ids[i]`` its token ids, and every other column of
the rows comes by name, one value per row (None where a row lacks it). ``None`` means the reward does not
apply to that row. ``async def`` rewards are awaited.

Beside TRL's arguments, as TRL passes its own extras (``trainer_state``) to rewards that take ``**kwargs``,
``truncated[i]`` says whether completion i hit the length limit (``max_new_tokens``) before its EOS: its text
is whatever the cut left (the first digits of an answer, say), which a reward may refuse to score. TRL tells
the same from ``completion_ids`` (a completion not ending in an EOS or pad token), which needs the tokenizer.

Feedback in words (the expected answer, the first failing test) becomes the SDPO teacher's hint
(``hints.py``). A reward gives it by returning ``{"rewards": [...], "feedback": [str | None, ...]}`` instead
of the list: the optional return form, the same length as the batch.

A run sums the configured rewards with their weights, skipping the None ones (TRL's ``nansum``: a row no
reward applies to scores 0); each reward's mean is logged under its name (the function's, or ``name``). A
reward of weight 0 is an evaluation metric: computed and logged like any, but left out of the sum and its
feedback out of the hints, so it changes nothing a step trains on.

Built in, in the same form: ``exact_match`` (the ``answer`` column, whitespace at either end ignored),
``format`` (a regex the whole completion must match), ``unit_tests`` (the ``tests`` column run against the
completion's code in a sandboxed subprocess, see ``sandbox``; the value is the fraction that pass). A user
reward is named by a file relative to the config (``my_task.py:accuracy``) or an import path
(``package.module:function``).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import os
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from composer_serverless.config import RewardConfig, RunConfig
from composer_serverless.config.code import CODE_DIR_ENV
from composer_serverless.config.composer import BUILTIN_COLUMNS
from composer_serverless.data.code_files import import_file
from composer_serverless.data.records import RESERVED_COLUMNS, PromptRecord

# Sandboxed test runs wait on child processes, not on the GIL, so a few run side by side.
SANDBOX_WORKERS = 4


class RewardError(ValueError):
    """A reward cannot be resolved, cannot be called as TRL calls rewards, or returned something else."""


@dataclass(frozen=True)
class Reward:
    """One configured reward: its name in metrics, its weight, the column it needs (built-ins), the function."""

    name: str
    weight: float
    needs: str | None
    fn: Callable[..., Any]

    def __call__(
        self,
        records: Sequence[PromptRecord],
        completions: Sequence[Any],
        completion_ids: Sequence[Sequence[int]],
        truncated: Sequence[bool] | None = None,
    ) -> tuple[list[float | None], list[str | None]]:
        """The values and feedback of ``completions`` of ``records``, checked.

        Raises:
            RewardError: the function cannot be called so, or returned something that is not rewards.
        """
        kwargs = call_arguments(records, completions, completion_ids, truncated)
        try:
            out = self.fn(**kwargs)
            if inspect.isawaitable(out):
                out = asyncio.run(_awaited(out))
        except TypeError as e:
            if _is_call_error(e, self.fn):
                raise RewardError(
                    f"reward {self.name!r} cannot be called as rewards are, fn(prompts, completions, "
                    f"completion_ids, **columns) with the columns {sorted(set(kwargs) - set(RESERVED_COLUMNS))}: "
                    f"{e}\n  fix: take the columns you need by name and accept the others with **kwargs"
                ) from e
            raise
        return _checked(out, len(records), self.name)


def call_arguments(
    records: Sequence[PromptRecord],
    completions: Sequence[Any],
    completion_ids: Sequence[Sequence[int]],
    truncated: Sequence[bool] | None = None,
) -> dict[str, Any]:
    """What a reward is called with: TRL's ``prompts``, ``completions``, ``completion_ids``, whether each
    completion was ``truncated`` (None: none was) and every column of the rows, a value per row (None where a
    row lacks the column)."""
    cut = [False] * len(completions) if truncated is None else [bool(t) for t in truncated]
    if not len(records) == len(completions) == len(completion_ids) == len(cut):
        raise ValueError(f"{len(completions)} completions for {len(records)} records")
    names = list(dict.fromkeys(name for r in records for name in r.columns))
    return {
        "prompts": [r.prompt if isinstance(r.prompt, str) else list(r.prompt) for r in records],
        "completions": [
            c if isinstance(c, list) or not r.conversational else [{"role": "assistant", "content": c}]
            for r, c in zip(records, completions, strict=True)
        ],
        "completion_ids": [list(ids) for ids in completion_ids],
        "truncated": cut,
        **{name: [r.columns.get(name) for r in records] for name in names},
    }


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _is_call_error(error: TypeError, fn: Callable[..., Any]) -> bool:
    """Whether ``error`` is about how ``fn`` was called (its signature), not raised inside it."""
    frames = []
    tb = error.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code)
        tb = tb.tb_next
    code = getattr(inspect.unwrap(fn), "__code__", None)
    return code is None or code not in frames


def _checked(out: Any, rows: int, name: str) -> tuple[list[float | None], list[str | None]]:
    feedback: list[str | None] = [None] * rows
    if isinstance(out, dict):
        if set(out) - {"rewards", "feedback"} or "rewards" not in out:
            raise RewardError(
                f"reward {name!r} returned a dict with keys {sorted(out)}; the feedback form is "
                "{'rewards': [...], 'feedback': [...]}"
            )
        feedback = list(out.get("feedback") or feedback)
        out = out["rewards"]
        if len(feedback) != rows or not all(f is None or isinstance(f, str) for f in feedback):
            raise RewardError(
                f"reward {name!r}: 'feedback' must be {rows} strings or None, one per completion"
            )
    if not isinstance(out, (list, tuple)) or len(out) != rows:
        shown = f"{len(out)} values" if isinstance(out, (list, tuple)) else type(out).__name__
        raise RewardError(
            f"reward {name!r} returned {shown} for {rows} completions; return a list, one value each"
        )
    values: list[float | None] = []
    for value in out:
        if value is None:
            values.append(None)
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise RewardError(
                f"reward {name!r} returned {value!r}; a reward is a finite number, or None where it does not apply"
            )
        values.append(float(value))
    return values, feedback


# --- the built-ins, written as any reward is ------------------------------------------------------------


def _text(completion: Any) -> str:
    """The completion's text, from a string or a conversational completion."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def exact_match(completions: list[Any], answer: list[Any] | None = None, **columns: Any) -> dict[str, list]:
    """1 if the completion is the row's ``answer`` (surrounding whitespace ignored), else 0 and the answer;
    None for a row without one."""
    answers = answer or [None] * len(completions)
    rewards: list[float | None] = []
    feedback: list[str | None] = []
    for completion, expected in zip(completions, answers, strict=True):
        if expected is None:
            rewards.append(None)
            feedback.append(None)
        elif _text(completion).strip() == str(expected).strip():
            rewards.append(1.0)
            feedback.append(None)
        else:
            rewards.append(0.0)
            feedback.append(f"The expected answer is {str(expected).strip()}.")
    return {"rewards": rewards, "feedback": feedback}


def format_reward(pattern: str) -> Callable[..., dict[str, list]]:
    """A reward of 1 when the whole completion matches ``pattern`` (``re.fullmatch``), else 0."""
    compiled = re.compile(pattern)

    def matches(completions: list[Any], **columns: Any) -> dict[str, list]:
        matched = [compiled.fullmatch(_text(c)) is not None for c in completions]
        return {
            "rewards": [1.0 if m else 0.0 for m in matched],
            "feedback": [None if m else f"The answer must match the pattern {pattern}." for m in matched],
        }

    return matches


def unit_tests(timeout_s: float) -> Callable[..., dict[str, list]]:
    """The fraction of the row's ``tests`` that pass against the completion's code, run in the sandbox; None
    for a row without tests."""
    from composer_serverless.environments.sandbox import run_tests

    def one(completion: Any, tests: Any) -> tuple[float | None, str | None]:
        if not tests:
            return None, None
        result = run_tests(
            _text(completion), (tests,) if isinstance(tests, str) else tuple(tests), timeout_s=timeout_s
        )
        failure = result.first_failure()
        return result.passed_fraction, None if failure is None else f"A test failed: {failure}"

    def run(completions: list[Any], tests: list[Any] | None = None, **columns: Any) -> dict[str, list]:
        with ThreadPoolExecutor(SANDBOX_WORKERS) as pool:
            scored = list(pool.map(one, completions, tests or [None] * len(completions)))
        return {"rewards": [v for v, _ in scored], "feedback": [f for _, f in scored]}

    return run


# --- resolving a configured reward ----------------------------------------------------------------------


def load_user_reward(path: str, code_root: Path | None) -> Callable[..., Any]:
    """The callable ``path`` names: ``file.py:function`` (relative to ``code_root``: ``code.root``, or where
    the run's code was shipped) or ``package.module:function``.

    Raises:
        RewardError: the file or module does not import, has no such attribute, or it is not callable.
    """
    where, sep, attribute = path.rpartition(":")
    if not sep or not where or not attribute:
        raise RewardError(f"reward {path!r}: expected 'file.py:function' or 'package.module:function'")
    try:
        module = _import_file(where, code_root) if where.endswith(".py") else importlib.import_module(where)
    except RewardError:
        raise
    except Exception as e:  # whatever the import raised, the user's fix is the same: make it importable
        raise RewardError(
            f"reward {path!r}: importing {where!r} failed ({type(e).__name__}: {e})\n  fix: "
            + (
                "list the packages it needs in [code] requirements"
                if isinstance(e, ImportError)
                else "run the file on its own to see why"
            )
        ) from e
    fn = getattr(module, attribute, None)
    if fn is None:
        raise RewardError(f"reward {path!r}: {where!r} has no attribute {attribute!r}")
    if not callable(fn):
        raise RewardError(f"reward {path!r}: {attribute!r} is a {type(fn).__name__}, not a function")
    return fn


def code_root(config: RunConfig) -> Path | None:
    """Where this process finds the run's code: where it was shipped (``CODE_DIR_ENV``: fetched from the
    store, or in the Modal image), else ``code.root`` (a local run, the launcher)."""
    shipped = os.environ.get(CODE_DIR_ENV)
    root = shipped or config.code.root
    return None if root is None else Path(root)


def _import_file(relative: str, code_root: Path | None) -> Any:
    """The module of a reward file, imported by path (its directory first on ``sys.path``, so the file may
    import its neighbours), once per file."""
    if code_root is None:
        raise RewardError(
            f"reward file {relative!r}: no directory to find it in (launch the run from its config)"
        )
    path = (code_root / relative).resolve()
    if not path.is_file():
        raise RewardError(
            f"reward file {path} does not exist\n  fix: name it relative to the config file, or by absolute path"
        )
    return import_file(path)


def resolve(config: RewardConfig, code_root: Path | None = None) -> Reward:
    """The reward a `RewardConfig` names; user rewards are imported here (raises `RewardError`)."""
    if config.fn == "exact_match":
        fn: Callable[..., Any] = exact_match
    elif config.fn == "format":
        assert config.pattern is not None  # the config validates this
        fn = format_reward(config.pattern)
    elif config.fn == "unit_tests":
        fn = unit_tests(config.timeout_s)
    else:
        fn = load_user_reward(config.fn, code_root)
    name = config.name or (
        config.fn if config.fn in BUILTIN_COLUMNS or config.fn == "format" else fn.__name__
    )
    return Reward(name, config.weight, BUILTIN_COLUMNS.get(config.fn), fn)


@dataclass(frozen=True)
class Scored:
    """Rewards of a batch of completions.

    Attributes:
        totals: the weighted sum per completion, over the rewards that apply to it (0 if none does).
        by_reward: each reward's values by reward name, None where it does not apply.
        feedback: per completion, the feedback of every weighted reward that gave some, one per line; None if
            none did.
    """

    totals: list[float]
    by_reward: dict[str, list[float | None]]
    feedback: list[str | None]


def mean(values: Sequence[float | None]) -> tuple[float, int]:
    """(sum, count) of the values that are not None."""
    present = [v for v in values if v is not None]
    return sum(present), len(present)


class RewardSet:
    """The run's rewards, summed with their weights."""

    def __init__(self, configs: Sequence[RewardConfig], code_root: Path | None = None) -> None:
        rewards = [resolve(c, code_root) for c in configs]
        names = [r.name for r in rewards]
        # Two rewards of one name (two format patterns, say) get distinct metric names.
        self.rewards = [
            Reward(f"{r.name}#{i}", r.weight, r.needs, r.fn) if names.count(r.name) > 1 else r
            for i, r in enumerate(rewards)
        ]

    def score(
        self,
        completions: Sequence[Any],
        records: Sequence[PromptRecord],
        completion_ids: Sequence[Sequence[int]] | None = None,
        truncated: Sequence[bool] | None = None,
    ) -> Scored:
        """The rewards of ``completions`` of ``records``; ``truncated[i]``: completion i hit the length limit
        (None: none did)."""
        if len(completions) != len(records):
            raise ValueError(f"{len(completions)} completions for {len(records)} records")
        ids = completion_ids if completion_ids is not None else [[] for _ in completions]
        totals = [0.0] * len(completions)
        by_reward: dict[str, list[float | None]] = {}
        notes: list[list[str]] = [[] for _ in completions]
        for reward in self.rewards:
            values, feedback = reward(records, completions, ids, truncated)
            by_reward[reward.name] = values
            if reward.weight == 0:  # an evaluation metric
                continue
            for i, (value, note) in enumerate(zip(values, feedback, strict=True)):
                if value is not None:
                    totals[i] += reward.weight * value
                if note:
                    notes[i].append(note)
        return Scored(totals, by_reward, ["\n".join(n) if n else None for n in notes])
