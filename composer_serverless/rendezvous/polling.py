"""Waiting for something to appear in the store: one poll-until-deadline loop for every wait.

Replicas wait for each other only through objects (a quorum, reduced shards, evaluation shares, a published
round), so every wait is a poll. The pauses between polls grow from ``first_s`` to ``cap_s``: quick when the
object is about to appear, cheap (few requests, which on S3 cost money) when the wait is long. They are
jittered so that N replicas that began waiting together do not poll in step.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Clock:
    """Where a wait reads the time (``time.monotonic`` seconds) and pauses: this process's own clock, or a
    test's, which can let minutes pass at once."""

    now: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep


MONOTONIC = Clock()

FIRST_S = 0.005
CAP_S = 0.5
GROWTH = 1.5


def poll_until(
    check: Callable[[], T | None],
    deadline: float,
    *,
    first_s: float = FIRST_S,
    cap_s: float = CAP_S,
    clock: Clock = MONOTONIC,
) -> T | None:
    """Call ``check`` until it returns something other than None, and return that; None once ``deadline``
    (a ``clock.now()`` value) has passed. ``check`` runs at least once, and once more at the deadline."""
    delay = first_s
    while True:
        result = check()
        if result is not None:
            return result
        left = deadline - clock.now()
        if left <= 0:
            return None
        clock.sleep(min(left, delay * (0.5 + random.random())))
        delay = min(cap_s, delay * GROWTH)
