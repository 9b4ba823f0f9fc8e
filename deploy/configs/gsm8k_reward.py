"""Rewards for GSM8K-shaped math word problems, in TRL's form (``fn(prompts, completions, completion_ids,
**columns)``): the final answer is the number after GSM8K's ``####``.

``correct`` gives the right answer as feedback when a completion is wrong, the optional return form that
turns the SDPO channel on (its hint); ``formatted`` pays for ending with ``#### <number>``, GSM8K's own answer
format, which ``correct`` reads first.
"""

from __future__ import annotations

import re

_FINAL = re.compile(r"####\s*(-?[\d,]*\.?\d+)")
_NUMBER = re.compile(r"-?[\d,]*\.?\d+")


def final_number(text: str) -> float | None:
    """The number after the last ``####``, else the last number in ``text``; None if it has none."""
    found = _FINAL.findall(text) or _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def _text(completion) -> str:
    return completion if isinstance(completion, str) else completion[-1]["content"]


def correct(prompts, completions, answer, **kwargs):
    """1 when the completion's final number is the answer's, else 0 with the right answer as feedback."""
    rewards, feedback = [], []
    for completion, solution in zip(completions, answer, strict=True):
        gold = final_number(solution)
        if gold is None:  # a row without a final answer: this reward does not apply to it
            rewards.append(None)
            feedback.append(None)
            continue
        right = final_number(_text(completion)) == gold
        rewards.append(1.0 if right else 0.0)
        feedback.append(None if right else f"The correct final answer is {gold:g}.")
    return {"rewards": rewards, "feedback": feedback}


def formatted(prompts, completions, **kwargs):
    """1 when the completion ends with ``#### <number>``, else 0."""
    return [1.0 if re.search(r"####\s*-?[\d,]*\.?\d+\s*$", _text(c)) else 0.0 for c in completions]
