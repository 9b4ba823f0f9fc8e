"""Evaluation split across the replicas of a round: each scores a share of the held-out set, one adds them up.

An evaluation on one replica would make that replica late for the next sync by the whole evaluation's
time, every round, and everyone else would wait for it. Shared out, every participant spends 1/P of it.
What a share holds and how shares combine: ``objectives/shares.py``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

from composer_serverless.objectives.shares import EvalPart, combine
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.polling import poll_until
from composer_serverless.rendezvous.store import ObjectStore

# The shortest wait for the other participants' shares, beyond twice this replica's own share's time.
WAIT_MIN_S = 1.0
# Longest pause between polls of the store for the shares.
WAIT_POLL_CAP_S = 0.25


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


def evaluate_round(
    store: ObjectStore,
    round_index: int,
    participants: list[int],
    rank: int,
    score: Callable[[int, int], EvalPart],
    log: logging.LoggerAdapter,
) -> dict[str, float] | None:
    """Round ``round_index``'s evaluation, shared among its participants: this replica scores its share
    (``score(part, parts)``). The lowest-rank participant returns the whole evaluation: it gathers the other
    shares from the store and scores itself any that is malformed or has not come within twice its own share's
    time (its replica died, or lags). The others publish their share and return None, and so does a replica
    that took the round's result without taking part in it (it has no share)."""
    if rank not in participants:
        return None
    parts, part = len(participants), participants.index(rank)
    started = time.monotonic()
    shares = {part: score(part, parts)}
    if part != 0:
        store.put(layout.eval_share(round_index, part, parts), dumps(shares[part]))
        return None

    def collected() -> bool | None:
        for p in range(1, parts):
            if p not in shares and (got := _collect(store, round_index, p, parts, score, log)) is not None:
                shares[p] = got
        return True if len(shares) == parts else None

    deadline = time.monotonic() + WAIT_MIN_S + 2 * (time.monotonic() - started)
    if poll_until(collected, deadline, first_s=0.01, cap_s=WAIT_POLL_CAP_S) is None:
        missing = [participants[p] for p in range(parts) if p not in shares]
        log.warning("round %d: scoring the evaluation shares of replicas %s here", round_index, missing)
        for p in range(parts):
            if p not in shares:
                shares[p] = score(p, parts)
    return combine([shares[p] for p in range(parts)])


def _collect(
    store: ObjectStore,
    round_index: int,
    part: int,
    parts: int,
    score: Callable[[int, int], EvalPart],
    log: logging.LoggerAdapter,
) -> EvalPart | None:
    """Share ``part`` as published, None while it has not come. A share is written once, so a malformed one
    will never become valid: it is scored here at once, not polled for until the deadline."""
    try:
        return loads(store.get(layout.eval_share(round_index, part, parts)))
    except FileNotFoundError:
        return None
    except ValueError as e:
        log.warning("round %d: evaluation share %d is malformed (%s); scoring it here", round_index, part, e)
        return score(part, parts)
