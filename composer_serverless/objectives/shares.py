"""A held-out evaluation in shares: which items a share holds, and the means of shares added up.

An objective scores one share of its held-out set (``Objective.evaluate_part``); the replica loop shares a
round's evaluation among its participants (``replicas/evaluation.py``) and combines what they scored. A share
reports sums and counts rather than means, so shares of different sizes (and a task missing from a share)
combine into exactly the means over the whole set.
"""

from __future__ import annotations

# metric -> (sum of the values in the share, how many values)
EvalPart = dict[str, tuple[float, int]]


def share(items: list, part: int, parts: int) -> list:
    """The items of share ``part`` of ``parts``: every ``parts``-th one, so each share samples the whole set."""
    if not 0 <= part < parts:
        raise ValueError(f"part {part} is outside [0, {parts})")
    return items[part::parts]


def combine(parts: list[EvalPart]) -> dict[str, float]:
    """The mean of each metric over every share that has values for it."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for part in parts:
        for name, (total, count) in part.items():
            sums[name] = sums.get(name, 0.0) + total
            counts[name] = counts.get(name, 0) + count
    return {name: sums[name] / counts[name] for name in sorted(sums) if counts[name] > 0}
