"""Seconds spent in each phase of a step, on the device's own clock.

On a GPU, kernels run behind the host: wall time around a phase measures how fast Python queued its kernels,
not how long they ran. CUDA events recorded at each boundary cost no host wait; they are read when the caller
waits for the device anyway (the end of a round, a read of generated tokens). On the CPU, wall time is the
device's time.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch


class PhaseClock:
    """``start()`` at the beginning of a stretch, ``lap(phase)`` at the end of each phase in it, ``read()``
    for the seconds per phase since the last read, ``read_stretches()`` for them per stretch (a trainer's
    per-step split, read once a round rather than making the host wait for the device after every step)."""

    def __init__(self, device: torch.device) -> None:
        self._events = device.type == "cuda"
        self._last: object = None
        self._stretch = -1
        self._laps: list[tuple[int, str, object, object]] = []

    def _now(self) -> object:
        if not self._events:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self._last = self._now()
        self._stretch += 1

    def lap(self, phase: str) -> None:
        """The phase that began at the previous ``start`` or ``lap`` ends now."""
        if self._last is None:
            raise RuntimeError("PhaseClock.lap() before start()")
        now = self._now()
        self._laps.append((self._stretch, phase, self._last, now))
        self._last = now

    def read(self) -> dict[str, float]:
        """Seconds per phase over the laps since the last read (on a GPU, waiting for the last lap's event
        unless it has passed already)."""
        totals: dict[str, float] = defaultdict(float)
        for stretch in self.read_stretches():
            for phase, seconds in stretch.items():
                totals[phase] += seconds
        return dict(totals)

    def read_stretches(self) -> list[dict[str, float]]:
        """Seconds per phase of each stretch (``start()``) with laps since the last read, in order."""
        laps, self._laps = self._laps, []
        if laps and self._events and not laps[-1][3].query():  # type: ignore[attr-defined]
            laps[-1][3].synchronize()  # type: ignore[attr-defined]
        stretches: dict[int, dict[str, float]] = {}
        for stretch, phase, begun, ended in laps:
            seconds = (
                begun.elapsed_time(ended) / 1000.0  # type: ignore[attr-defined]
                if self._events
                else ended - begun  # type: ignore[operator]
            )
            totals = stretches.setdefault(stretch, {})
            totals[phase] = totals.get(phase, 0.0) + seconds
        return list(stretches.values())
