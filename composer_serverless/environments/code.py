"""The built-in code environment (``environment = "builtin:code"``), the coding agent's episode.

The model has two tools. ``run_code`` runs a program in the sandbox (``sandbox.py``: a time limit, a memory
limit, no network) and answers with what it printed on stdout and stderr. ``submit`` runs the row's ``tests``
column (Python snippets, usually asserts, as the ``unit_tests`` reward reads them) against the solution and
ends the episode.

The environment owns the reward: the share of the tests the submission passes, the ``unit_tests`` reward's
value (so GRPO sees partial progress, not only 1 or 0); 0 when the model never submits. A program that raises
or is stopped at the time limit is an error site, its hint the last line of the traceback (or the timeout), so
SDPO's hint enters at that turn. A failing submission is not one: it ends the episode, and no model token comes
after it for the hint to teach.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transformers.utils import get_json_schema

from composer_serverless.environments.protocol import ErrorMark, Step, ToolCall, unknown_tool
from composer_serverless.environments.sandbox import ProgramResult, run_program, run_tests

# The most characters of a stream a tool answer shows: a program printing in a loop must not fill the
# episode's token budget (or the replica's memory) with one answer.
OUTPUT_CHARS = 2000
TESTS_COLUMN = "tests"


def _clip(text: str) -> str:
    """The head of a long text (a program's first output usually says most), with how much was left out."""
    if len(text) <= OUTPUT_CHARS:
        return text
    return text[:OUTPUT_CHARS] + f"\n... ({len(text) - OUTPUT_CHARS} more characters)"


def _tail(text: str) -> str:
    """The tail of a long text (a traceback ends with the error)."""
    return text if len(text) <= OUTPUT_CHARS else "..." + text[-OUTPUT_CHARS:]


def program_answer(result: ProgramResult) -> Step:
    """A run's tool turn: its stdout and stderr; an error site when it raised or was stopped."""
    parts = [
        f"{name}:\n{text}"
        for name, text in (("stdout", _clip(result.stdout)), ("stderr", _tail(result.stderr)))
        if text
    ]
    if result.timed_out:
        parts.append(f"stopped: the program {result.error}")
    observation = "\n".join(parts) or "(the program printed nothing)"
    if result.error is None:
        return Step(observation)
    kind = "code_timeout" if result.timed_out else "code_raised"
    return Step(observation, error=ErrorMark(kind, result.error))


def row_tests(row: dict[str, Any]) -> tuple[str, ...]:
    """The row's tests (a snippet or a list of them); raises ``ValueError`` when it has none."""
    tests = row.get(TESTS_COLUMN)
    tests = (tests,) if isinstance(tests, str) else tuple(tests or ())
    if not tests or not all(isinstance(t, str) for t in tests):
        raise ValueError(
            f"builtin:code needs a {TESTS_COLUMN!r} column on every row, a list of Python snippets (usually "
            f"asserts) the submitted code must pass; this row has {row.get(TESTS_COLUMN)!r}\n  fix: add the "
            f'column, or map yours to it: [composer.data.columns] {TESTS_COLUMN} = "<its name>"'
        )
    return tests


class CodeEnvironment:
    """One coding episode: run code as often as the turns allow, submit once.

    Attributes:
        submitted: whether the model submitted (the episode is over).
        passed: how many of the row's tests the submission passed.
        runs: how many programs the model ran.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.tests: tuple[str, ...] = ()
        self.submitted = False
        self.passed = 0
        self.runs = 0
        self._tools: dict[str, Callable[[str], Step]] = {"run_code": self.run_code, "submit": self.submit}
        self.tools = [get_json_schema(fn) for fn in self._tools.values()]

    def reset(self, row: dict[str, Any]) -> str | None:
        self.tests = row_tests(row)
        self.submitted, self.passed, self.runs = False, 0, 0
        return None

    def run_code(self, code: str) -> Step:
        """Run a Python program and see what it prints on stdout and stderr (no network, limited time).

        Args:
            code: the program's source
        """
        self.runs += 1
        return program_answer(run_program(code, timeout_s=self.timeout_s))

    def submit(self, code: str) -> Step:
        """Submit the solution: its unit tests are run and the episode ends.

        Args:
            code: the solution's source, defining what the task asks for
        """
        if self.submitted:
            return Step("already submitted: only the first submission counts", done=True)
        result = run_tests(code, self.tests, timeout_s=self.timeout_s)
        self.submitted, self.passed = True, sum(t.passed for t in result.tests)
        failure = result.first_failure()
        summary = f"{self.passed}/{len(self.tests)} tests passed"
        return Step(summary if failure is None else f"{summary}; first failure: {failure}", done=True)

    def step(self, call: ToolCall) -> Step:
        tool = self._tools.get(call.name)
        if tool is None:
            return unknown_tool(call.name, self._tools)
        code = call.arguments.get("code")
        if set(call.arguments) != {"code"} or not isinstance(code, str):
            return Step(
                json.dumps({"error": f"{call.name} takes one argument, code, a string"}),
                error=ErrorMark(
                    "bad_arguments",
                    f"{call.name} was called with {sorted(call.arguments)}; it takes one argument, code: the "
                    "program's source as a string",
                ),
            )
        return tool(code)

    def state(self) -> dict[str, Any]:
        return {
            "submitted": self.submitted,
            "passed": self.passed,
            "tests": len(self.tests),
            "runs": self.runs,
        }

    def reward(self) -> float | None:
        return self.passed / len(self.tests) if self.submitted else 0.0

    def close(self) -> None:
        """Nothing to release: each program's sandbox is gone when its call returns."""


@dataclass(frozen=True)
class CodeEnvironments:
    """A fresh ``CodeEnvironment`` per episode; they own the reward."""

    timeout_s: float
    owns_reward: bool = True
    reward_name: str = "tests_passed"

    def __call__(self) -> CodeEnvironment:
        return CodeEnvironment(self.timeout_s)
