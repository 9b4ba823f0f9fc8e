"""Evaluation split across the replicas of a round: each scores a share of the held-out set, one adds them up.

An evaluation on one replica would make that replica late for the next sync by the whole evaluation's
time, every round, and everyone else would wait for it. Shared out, every participant spends 1/P of it.
A share reports sums and counts rather than means, so shares of different sizes (and a task missing from
a share) combine into exactly the means over the whole set.
"""

from __future__ import annotations

import json

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


def dumps(part: EvalPart) -> bytes:
    return json.dumps({name: [total, count] for name, (total, count) in part.items()}).encode()


def loads(raw: bytes) -> EvalPart:
    """A share read from the store: JSON of ``{metric: [sum, count]}``, checked field by field.

    Raises:
        ValueError: anything else.
    """
    data = json.loads(raw)
    if not isinstance(data, dict):
        raise ValueError("an evaluation share must be a JSON object")
    out: EvalPart = {}
    for name, value in data.items():
        if (
            not isinstance(value, list)
            or len(value) != 2
            or not isinstance(value[0], (int, float))
            or isinstance(value[0], bool)
            or not isinstance(value[1], int)
            or isinstance(value[1], bool)
            or value[1] < 0
        ):
            raise ValueError(f"evaluation share entry {name!r} is not [sum, count]: {value!r}")
        out[name] = (float(value[0]), value[1])
    return out
