"""Heartbeats and per-round metrics: what replicas tell the launcher, through the store only.

Object stores cannot append, so each replica overwrites one small heartbeat object (``layout.heartbeat``)
and writes one object per round (``layout.metrics``). The launcher (or anyone holding the run URL) reads
them back to draw progress and write the report.
"""

from __future__ import annotations

import json
import time
from typing import Any

from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import ObjectStore

# Each heartbeat is one PUT; on S3 that is money and request budget, so at most one every few seconds.
HEARTBEAT_EVERY_S = 2.0
# A step's figures, which the beats after it that have none (waiting between rounds, done, failed) carry on:
# ``status`` shows a replica's latest, as the launcher's progress bars keep it on screen.
CARRIED = ("loss", "reward")


class Reporter:
    """Writes this replica's heartbeat (throttled) and its per-round metrics.

    A beat that changes the replica's state or round is always written: the launcher's progress, and
    anything that watches for a replica to enter a round, see the change at once rather than up to
    ``HEARTBEAT_EVERY_S`` later (a short round could otherwise pass without ever being announced).

    A replica of several ranks speaks through its lead: the other ranks' reporters are ``silent``.
    """

    def __init__(self, run: ObjectStore, rank: int, *, silent: bool = False) -> None:
        self._run = run
        self._rank = rank
        self._silent = silent
        self._last_beat = 0.0
        self._last_phase: tuple[Any, Any] | None = None
        self._carried: dict[str, Any] = {}

    def beat(self, **fields: Any) -> None:
        # Taken from a throttled beat too: the next beat written carries the latest step's figures.
        self._carried.update({name: fields[name] for name in CARRIED if name in fields})
        fields = {**self._carried, **fields}
        now = time.time()
        phase = (fields.get("state"), fields.get("round"))
        if self._silent or phase == self._last_phase and now - self._last_beat < HEARTBEAT_EVERY_S:
            return
        self._last_beat, self._last_phase = now, phase
        self._run.put(layout.heartbeat(self._rank), _dumps({"rank": self._rank, "time": now, **fields}))

    def round(self, round_index: int, metrics: dict[str, Any]) -> None:
        if self._silent:
            return
        row = {"rank": self._rank, "round": round_index, **metrics}
        self._run.put(layout.metrics(self._rank, round_index), _dumps(row))


def read_heartbeats(run: ObjectStore) -> dict[int, dict[str, Any]]:
    beats = {}
    for name in run.list(layout.MEMBERS):
        if name.endswith(".json"):
            beat = json.loads(run.get(f"{layout.MEMBERS}/{name}"))
            beats[int(beat["rank"])] = beat
    return beats


def read_metrics(run: ObjectStore) -> dict[int, list[dict[str, Any]]]:
    """Every replica's per-round metrics, in round order."""
    out: dict[int, list[dict[str, Any]]] = {}
    for rank_name in run.list(layout.METRICS):
        rank = int(rank_name)
        prefix = layout.metrics_dir(rank)
        rows = [json.loads(run.get(f"{prefix}/{name}")) for name in run.list(prefix)]
        out[rank] = sorted(rows, key=lambda row: row["round"])
    return out


def mean_metrics(steps: list[dict[str, float]]) -> dict[str, float]:
    """Per metric, its mean over the steps that reported it (a channel without inputs reports nothing)."""
    values: dict[str, list[float]] = {}
    for step in steps:
        for name, value in step.items():
            values.setdefault(name, []).append(value)
    return {name: sum(v) / len(v) for name, v in sorted(values.items())}


def _dumps(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, sort_keys=True).encode()
