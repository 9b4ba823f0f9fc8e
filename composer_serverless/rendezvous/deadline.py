"""How long the first replicas to arrive wait for the rest before fixing a quorum without them.

A fixed timeout is wrong both ways (hivemind#676): too short and a replica that is merely slow is dropped
every round; too long and a dead replica stalls everyone for the whole timeout every round. So each replica
remembers, for the recent syncs in which every replica arrived, how long after its own arrival the last one
came, and waits the median of those plus ``mads`` scaled median absolute deviations. The replica that
arrives first waits longest in healthy rounds, so its estimate is the generous one, and it is also the one
whose deadline fixes the quorum when a replica is missing. Until anything has been observed (the first sync
of a process, when start-up times differ most) the wait is the cap.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

# MAD * 1.4826 estimates the standard deviation of normally distributed samples.
_MAD_TO_SIGMA = 1.4826


@dataclass(frozen=True)
class GraceSettings:
    """Bounds and width of the adaptive wait; see the ``[diloco]`` config keys of the same names."""

    min_s: float
    max_s: float
    mads: float
    window: int = 32


def grace_s(waits: list[float], settings: GraceSettings) -> float:
    """The wait for stragglers given recent full-arrival waits: median + mads * sigma, clamped to the bounds."""
    if not waits:
        return settings.max_s
    median = statistics.median(waits)
    sigma = _MAD_TO_SIGMA * statistics.median(abs(w - median) for w in waits)
    return min(settings.max_s, max(settings.min_s, median + settings.mads * sigma))


class ArrivalHistory:
    """The recent waits one replica observed until every replica had arrived."""

    def __init__(self, settings: GraceSettings) -> None:
        self.settings = settings
        self._waits: deque[float] = deque(maxlen=settings.window)

    def observe(self, wait_s: float) -> None:
        self._waits.append(max(0.0, wait_s))

    def grace_s(self) -> float:
        return grace_s(list(self._waits), self.settings)
