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
    for the seconds per phase since the last read."""

    def __init__(self, device: torch.device) -> None:
        self._events = device.type == "cuda"
        self._last: object = None
        self._laps: list[tuple[str, object, object]] = []

    def _now(self) -> object:
        if not self._events:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self._last = self._now()

    def lap(self, phase: str) -> None:
        """The phase that began at the previous ``start`` or ``lap`` ends now."""
        if self._last is None:
            raise RuntimeError("PhaseClock.lap() before start()")
        now = self._now()
        self._laps.append((phase, self._last, now))
        self._last = now

    def read(self) -> dict[str, float]:
        """Seconds per phase over the laps since the last read (on a GPU, waiting for the last lap's event
        unless it has passed already)."""
        laps, self._laps = self._laps, []
        totals: dict[str, float] = defaultdict(float)
        if laps and self._events and not laps[-1][2].query():  # type: ignore[attr-defined]
            laps[-1][2].synchronize()  # type: ignore[attr-defined]
        for phase, begun, ended in laps:
            if self._events:
                totals[phase] += begun.elapsed_time(ended) / 1000.0  # type: ignore[attr-defined]
            else:
                totals[phase] += ended - begun  # type: ignore[operator]
        return dict(totals)
