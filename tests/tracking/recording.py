"""A tracker that records what relays log to it, for tests of the relay and the chaos benchmark: every relay of
a process opens its tracker runs through ``Recorded.open`` (patched in for ``relay.open_tracker``), and all of
them log into one record, so that steps logged twice (by two relays) or never show up in ``miscounted``.

A relay can be held still in the middle of a round (``hold``): the deterministic stand-in for a relay that
pauses (a stopped process, a slow tracker, a laptop asleep) while another goes on; and a tracker can fail in
the middle of one (``fail``).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

# The key every inner step carries (``series.step_points``); a round's summary at its last step does not.
STEP_KEY = "train/loss"


class Recorded:
    """Everything logged by every relay's tracker runs in this process, per tracker name."""

    def __init__(self) -> None:
        self.steps: dict[str, list[int]] = {}
        self.configs: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._hold: tuple[str, int] | None = None
        self._fail: int | None = None
        self.held = threading.Event()
        self.resume = threading.Event()

    def hold(self, thread: str, step: int) -> None:
        """Hold the relay running in thread ``thread`` as it logs ``step`` (``held`` is set) until ``resume``."""
        self._hold = (thread, step)

    def fail(self, step: int) -> None:
        """Make the next tracker that logs ``step`` raise (a tracker's client failing mid-round), once."""
        self._fail = step

    def open(self, name: str, tracking: Any, run_id: str, config: dict[str, Any], directory: Path) -> Any:
        """``open_tracker``'s signature: a recording tracker run for tracker ``name``."""
        del tracking, run_id, config, directory
        return _RecordingTracker(name, self)

    def log(self, name: str, step: int, values: dict[str, float]) -> None:
        if STEP_KEY in values and self._fail == step:
            self._fail = None
            raise RuntimeError(f"{name} failed at step {step}")
        if STEP_KEY in values and self._hold == (threading.current_thread().name, step):
            self.held.set()
            assert self.resume.wait(60), "the test never resumed the held relay"
        if STEP_KEY in values:
            with self._lock:
                self.steps.setdefault(name, []).append(step)

    def miscounted(self, names: Iterable[str], expected: Iterable[int]) -> dict[str, dict[int, int]]:
        """Per tracker, each step logged other than exactly once (0: skipped), and each step logged that no
        round has; empty when every relay together logged each expected step once."""
        expected = set(expected)
        out: dict[str, dict[int, int]] = {}
        for name in names:
            counts = Counter(self.steps.get(name, []))
            steps = sorted(expected | set(counts))
            wrong = {step: counts[step] for step in steps if counts[step] != (step in expected)}
            if wrong:
                out[name] = wrong
        return out


class _RecordingTracker:
    def __init__(self, name: str, recorded: Recorded) -> None:
        self.name = name
        self._recorded = recorded

    def log_config(self) -> None:
        self._recorded.configs[self.name] += 1

    def log(self, step: int, values: dict[str, float]) -> None:
        self._recorded.log(self.name, step, values)

    def table(self, step: int, key: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        del step, key, columns, rows

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass
