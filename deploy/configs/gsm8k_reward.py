"""Rewards for GSM8K-shaped math word problems, in TRL's form (``fn(prompts, completions, completion_ids,
**columns)``).

The recipe's system prompt asks for the final answer on its own last line as ``#### <number>``, GSM8K's own
answer format, and both rewards read that line only: ``####``, then a number (a sign, digits with or without
thousands commas, decimals) and nothing else. Anything else earns nothing: a number elsewhere in the text
(an intermediate result, a stray digit of noise), ``\\boxed{72}``, ``#### $72``, ``#### 72.``, ``#### 72
clips``. A scorer that takes the last number it finds pays for noise and for unfinished reasoning, and the
policy learns to produce them.

A completion that hit the length limit (``truncated``, which composer-serverless passes beside TRL's
arguments) scores 0 on both: its last line is whatever the cut left, such as the first digits of ``#### 72``.
Under TRL, which does not pass it, a completion counts as finished.

``correct`` gives the right answer as feedback when a completion is wrong, the optional return form that
turns the SDPO channel on (its hint); ``formatted`` pays for the answer line alone, right or wrong.
"""

from __future__ import annotations

import re

# The whole last line: "####", then a number as GSM8K writes it (1200, 1,200, -3, 0.5), then nothing.
_ANSWER_LINE = re.compile(r"####[ \t]*(-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)[ \t]*")


def final_answer(text: str) -> str | None:
    """The number on ``text``'s last non-empty line, without its commas, when that line is ``#### <number>``;
    else None."""
    lines = text.strip().splitlines()
    found = _ANSWER_LINE.fullmatch(lines[-1].strip()) if lines else None
    return None if found is None else found.group(1).replace(",", "")


def _text(completion) -> str:
    return completion if isinstance(completion, str) else completion[-1]["content"]


def _cut(truncated, completions) -> list[bool]:
    return list(truncated) if truncated is not None else [False] * len(completions)


def correct(prompts, completions, answer, truncated=None, **kwargs):
    """1 when the completion's answer line holds the row's answer, else 0 with the right answer as feedback;
    None for a row whose ``answer`` has no ``#### <number>`` line."""
    rewards, feedback = [], []
    for completion, solution, cut in zip(completions, answer, _cut(truncated, completions), strict=True):
        gold = final_answer(solution or "")
        if gold is None:  # a row without a final answer: this reward does not apply to it
            rewards.append(None)
            feedback.append(None)
            continue
        given = None if cut else final_answer(_text(completion))
        right = given is not None and float(given) == float(gold)  # 72 is 72.0
        rewards.append(1.0 if right else 0.0)
        feedback.append(None if right else f"The correct final answer is {gold}.")
    return {"rewards": rewards, "feedback": feedback}


def formatted(prompts, completions, truncated=None, **kwargs):
    """1 when the completion ends with its answer line, ``#### <number>``, else 0."""
    return [
        1.0 if not cut and final_answer(_text(c)) is not None else 0.0
        for c, cut in zip(completions, _cut(truncated, completions), strict=True)
    ]
