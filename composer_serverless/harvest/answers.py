"""Answers compared: normalisation, the final-answer rule, and the vote that picks the chosen answer.

Pure functions: what two answers "agree" means is decided here alone, so the harvest, its tests and anyone
reading a pair's provenance apply the same rule.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from composer_serverless.config import NormaliseConfig

_WHITESPACE = re.compile(r"\s+")


@dataclass(frozen=True)
class Answer:
    """One text reduced for comparison.

    Attributes:
        text: the answer as written, after extraction and trimming but before case folding: what a pair's
            chosen side holds.
        key: what is compared (``text`` case-folded if so configured).
    """

    text: str
    key: str


def _tidy(text: str, rule: NormaliseConfig) -> str:
    if rule.collapse_whitespace:
        text = _WHITESPACE.sub(" ", text)
    if rule.strip:
        text = text.strip()
    if rule.trim_chars:
        text = text.strip(rule.trim_chars)
        if rule.strip:
            text = text.strip()
    return text


def extract(text: str, rule: NormaliseConfig) -> str | None:
    """The final answer of ``text``: the last match of ``rule.final_answer`` (its group if it has one), or
    the whole text when no rule is set; None when the rule finds nothing."""
    if rule.final_answer is None:
        return text
    matches = list(re.finditer(rule.final_answer, text))
    if not matches:
        return None
    last = matches[-1]
    return last.group(1) if last.re.groups else last.group(0)


def normalise(text: str, rule: NormaliseConfig) -> Answer | None:
    """A teacher's answer for the vote; None (an abstention) when the final-answer rule finds nothing or
    nothing is left."""
    found = extract(text, rule)
    if found is None:
        return None
    tidy = _tidy(found, rule)
    if not tidy:
        return None
    return Answer(tidy, tidy.casefold() if rule.casefold else tidy)


def normalise_student(text: str, rule: NormaliseConfig) -> Answer:
    """The student's answer: as a teacher's, but compared whole when the rule finds nothing in it (a student
    trained to answer bare is not held to the teachers' format)."""
    answer = normalise(text, rule)
    if answer is not None:
        return answer
    tidy = _tidy(text, rule)
    return Answer(tidy, tidy.casefold() if rule.casefold else tidy)


@dataclass(frozen=True)
class Verdict:
    """What the teachers agreed on.

    Attributes:
        chosen: the winning answer (the first of its voters' texts, in teacher order); None without one.
        key: what it is compared by (``Answer.key``).
        votes: how many teachers gave it (for a tie or no winner: the largest count).
        voters: the names of the teachers that gave it.
        answered: teachers that gave an answer at all (the others failed or abstained).
        reason: "agreed", "below threshold" or "tied".
    """

    chosen: str | None
    key: str | None
    votes: int
    voters: tuple[str, ...]
    answered: int
    reason: str


def vote(answers: Mapping[str, Answer | None], threshold: int) -> Verdict:
    """The answer at least ``threshold`` teachers agree on (by ``Answer.key``), from ``answers`` keyed by
    teacher name in teacher order (None: no answer). Two answers both reaching the threshold tie, and a tie
    chooses nothing: the teachers do not agree."""
    given = {name: a for name, a in answers.items() if a is not None}
    counts = Counter(a.key for a in given.values())
    if not counts:
        return Verdict(None, None, 0, (), 0, "below threshold")
    ranked = counts.most_common()
    key, votes = ranked[0]
    if votes < threshold:
        return Verdict(None, None, votes, (), len(given), "below threshold")
    if len(ranked) > 1 and ranked[1][1] == votes:
        return Verdict(None, None, votes, (), len(given), "tied")
    voters = tuple(name for name, a in given.items() if a.key == key)
    return Verdict(given[voters[0]].text, key, votes, voters, len(given), "agreed")
