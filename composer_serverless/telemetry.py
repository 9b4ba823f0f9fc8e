"""Heartbeats and per-round metrics: what replicas tell the launcher, through the store only.

Object stores cannot append, so each replica overwrites one small heartbeat object
(``members/{rank}.json``) and writes one object per round (``metrics/{rank}/{round}.json``). The launcher
(or anyone holding the run URL) reads them back to draw progress and write the report.
"""

from __future__ import annotations

import json
import time
from typing import Any

from composer_serverless.rendezvous.store import ObjectStore

# Each heartbeat is one PUT; on S3 that is money and request budget, so at most one every few seconds.
HEARTBEAT_EVERY_S = 2.0


def heartbeat_key(rank: int) -> str:
    return f"members/{rank}.json"


def metrics_key(rank: int, round_index: int) -> str:
    return f"metrics/{rank}/{round_index:06d}.json"


class Reporter:
    """Writes this replica's heartbeat (throttled) and its per-round metrics."""

    def __init__(self, run: ObjectStore, rank: int) -> None:
        self._run = run
        self._rank = rank
        self._last_beat = 0.0

    def beat(self, *, force: bool = False, **fields: Any) -> None:
        now = time.time()
        if not force and now - self._last_beat < HEARTBEAT_EVERY_S:
            return
        self._last_beat = now
        self._run.put(heartbeat_key(self._rank), _dumps({"rank": self._rank, "time": now, **fields}))

    def round(self, round_index: int, metrics: dict[str, Any]) -> None:
        self._run.put(
            metrics_key(self._rank, round_index),
            _dumps({"rank": self._rank, "round": round_index, **metrics}),
        )


def read_heartbeats(run: ObjectStore) -> dict[int, dict[str, Any]]:
    beats = {}
    for name in run.list("members"):
        if name.endswith(".json"):
            beat = json.loads(run.get(f"members/{name}"))
            beats[int(beat["rank"])] = beat
    return beats


def read_metrics(run: ObjectStore) -> dict[int, list[dict[str, Any]]]:
    """Every replica's per-round metrics, in round order."""
    out: dict[int, list[dict[str, Any]]] = {}
    for rank_name in run.list("metrics"):
        rows = [json.loads(run.get(f"metrics/{rank_name}/{n}")) for n in run.list(f"metrics/{rank_name}")]
        out[int(rank_name)] = sorted(rows, key=lambda row: row["round"])
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
