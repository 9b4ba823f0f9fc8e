"""What a harvest did, per teacher and in all: the figures of the end-of-harvest table and of a live
harvest's report in the store."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from rich.table import Table


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile (0 < q <= 1) of ``values``: the smallest value with at least a share
    ``q`` of them at or below it; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@dataclass
class TeacherStats:
    """One teacher's part of a harvest.

    Attributes:
        requests / failed: HTTP requests sent, and those that brought no answer (error status, timeout,
            dropped connection, not a chat completion).
        answered / cached / unanswered: prompts answered by a request, from the cache, or not at all.
        latencies_s: of the requests that brought an answer.
        tokens_in / tokens_out: as the teacher's usage reported them.
        usd: charged by the cap's accounting (a response without usage at its worst case).
        saved_usd: what the answers taken from the cache cost when they were asked.
        disabled: why the teacher was asked nothing more (key or model wrong), if it was.
    """

    name: str
    requests: int = 0
    failed: int = 0
    answered: int = 0
    cached: int = 0
    unanswered: int = 0
    latencies_s: list[float] = field(default_factory=list)
    tokens_in: int = 0
    tokens_out: int = 0
    usd: Fraction = Fraction(0)
    saved_usd: float = 0.0
    disabled: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "teacher": self.name,
            "requests": self.requests,
            "failed": self.failed,
            "answered": self.answered,
            "cached": self.cached,
            "unanswered": self.unanswered,
            "p50_s": percentile(self.latencies_s, 0.5),
            "p95_s": percentile(self.latencies_s, 0.95),
            "tokens_in": self.tokens_in,
            "tokens_out": self.tokens_out,
            "usd": float(self.usd),
            "saved_usd": self.saved_usd,
            "disabled": self.disabled,
        }


@dataclass
class HarvestResult:
    """Pairs and figures of one harvest.

    Attributes:
        pairs: the preference pairs, as written (``prompt``, ``chosen``, ``rejected``, ``provenance``).
        states / prompts: states read, and distinct prompts asked about.
        verdicts: per prompt, what the teachers did: "agreed", "below threshold" or "tied".
        student_agreed: states whose student answer was the agreed one (no pair to make).
        spent: this harvest's charges; ``spent_before`` what the cap had counted before it (a live run's
            earlier harvests).
        refused: requests the cap did not allow; ``stopped`` why every request was refused, if it was.
    """

    pairs: list[dict[str, Any]]
    teachers: list[TeacherStats]
    states: int
    prompts: int
    verdicts: Counter[str]
    student_agreed: int
    spent: Fraction
    spent_before: Fraction
    max_usd: Fraction
    refused: int
    stopped: str | None
    wall_s: float

    @property
    def saved_usd(self) -> float:
        return sum(t.saved_usd for t in self.teachers)

    @property
    def problems(self) -> list[str]:
        """What kept the harvest from running as configured: a teacher disabled, the cost bound broken."""
        found = [f"teacher {t.name}: {t.disabled}" for t in self.teachers if t.disabled]
        return found + ([self.stopped] if self.stopped else [])

    def to_json(self) -> dict[str, Any]:
        return {
            "states": self.states,
            "prompts": self.prompts,
            "pairs": len(self.pairs),
            "verdicts": dict(self.verdicts),
            "student_agreed": self.student_agreed,
            "spent_usd": float(self.spent),
            "spent_before_usd": float(self.spent_before),
            "max_usd": float(self.max_usd),
            "saved_usd": self.saved_usd,
            "refused": self.refused,
            "stopped": self.stopped,
            "wall_s": self.wall_s,
            "teachers": [t.to_json() for t in self.teachers],
        }


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def usd(value: float | Fraction) -> str:
    """Dollars to the cent, or to the millionth below a cent (a harvest of short answers costs fractions of
    one)."""
    value = float(value)
    return f"${value:.2f}" if value >= 0.01 or value == 0 else f"${value:.6f}"


def table(result: HarvestResult) -> Table:
    """The end-of-harvest table: a row per teacher, then the totals."""
    out = Table(title=f"harvest: {result.states} states, {result.prompts} prompts asked")
    columns = ("teacher", "requests", "failed", "answered", "cached", "unanswered", "p50 s", "p95 s")
    for column in (*columns, "tokens in", "tokens out", "USD"):
        out.add_column(column, justify="left" if column == "teacher" else "right", no_wrap=True)
    for t in result.teachers:
        out.add_row(
            t.name + (" (disabled)" if t.disabled else ""),
            str(t.requests),
            str(t.failed),
            str(t.answered),
            str(t.cached),
            str(t.unanswered),
            _seconds(percentile(t.latencies_s, 0.5)),
            _seconds(percentile(t.latencies_s, 0.95)),
            f"{t.tokens_in:,}",
            f"{t.tokens_out:,}",
            usd(t.usd),
        )
    return out


def summary_lines(result: HarvestResult) -> list[str]:
    """The totals under the table."""
    verdicts = ", ".join(f"{n} {what}" for what, n in sorted(result.verdicts.items())) or "none"
    lines = [
        f"spent {usd(result.spent)}"
        + (f" ({usd(result.spent + result.spent_before)} in the run)" if result.spent_before else "")
        + f" of the {usd(result.max_usd)} cap; saved by the cache {usd(result.saved_usd)}",
        f"pairs produced: {len(result.pairs)} (prompts: {verdicts}; {result.student_agreed} states where the "
        "student already gave the agreed answer)",
    ]
    if result.refused:
        lines.append(f"{result.refused} requests were not sent: the cap would not allow them")
    return lines
