"""The relay: the launcher (while it watches) and ``status`` (whenever it is run) carry the run's metrics from
the store to its trackers, catching up on whatever nobody relayed before.

Why a relay, not replicas logging themselves: the replicas already write every step to the store (one row per
round, ``replicas/meter.py``), so the relay costs them nothing, while a tracker client in each replica would
cost each one its start-up and a service process beside training, need the tracker's key as one more secret
on every replica, and give N writers to one tracker run, which trackio and TensorBoard do not support
(``benchmarks/tracking.py`` measures the costs). What a relay gives up, it gets back from the store: a run
nobody watches (a detached launcher, a closed laptop) keeps its metrics there, and the next relay logs them.

Exactly once: a relay logs whole rounds in order and records, per tracker, the last round logged
(``tracking/relayed.json``) after each one, so a relay that starts again goes on from there. A lease
(``tracking/lease.json``) keeps a second relay (``status`` run while the launcher watches) from logging the
same rounds at the same time. A relay killed between logging a round and recording it logs that round again
when it is next run (W&B keeps the first values of a step; TensorBoard and trackio show both): the one case
where a step can reach a tracker twice. A round the run redoes after a rollback keeps its first values in the
trackers; the store holds the redone ones.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import time
from pathlib import Path
from typing import Any

from composer_serverless.config import RunConfig
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.tracking import series
from composer_serverless.tracking.trackers import TensorBoardTracker, Tracker, open_tracker

logger = logging.getLogger(__name__)

# How long a relay's lease lasts unless renewed: longer than any pause between two of its passes.
LEASE_S = 120.0
_ROW_NAME = re.compile(r"^(\d+)\.json$")


class Relay:
    """Relays one run's rounds to the trackers its config names (``tracking.report_to``)."""

    def __init__(self, run: ObjectStore, config: RunConfig) -> None:
        self._run = run
        self._config = config
        self._names = list(config.tracking.report_to)
        self._owner = secrets.token_hex(8)
        self._trackers: dict[str, Tracker] = {}
        self._held = False

    def open(self) -> None:
        """Open every tracker run now (W&B takes a second or so to start its service), not at the first round
        to relay: a watch that opens them before it starts watching is never held up by it later."""
        relayed = self._relayed()
        for name in self._names:
            self._tracker(name, fresh=name not in relayed)

    def catch_up(self, *, ended: bool) -> int:
        """Log every round that is ready and not yet relayed; returns the steps logged (0 when another relay
        holds the lease). ``ended``: the run succeeded, so every round is as complete as it will be."""
        if not self._names or not self._lease():
            return 0
        relayed = self._relayed()
        start = min(relayed.get(name, -1) for name in self._names) + 1
        rows = self._rows_from(start)
        dl = self._config.diloco
        logged = 0
        for k in range(start, dl.rounds + 1):
            if not series.ready(rows, k, ended=ended):
                break
            this = series.round_rows(rows, k)
            points = series.step_points(this, k, dl.sync_every) if k > 0 else []
            summary = series.round_point(this)
            table = series.completions(this, k)
            for name in self._names:
                if relayed.get(name, -1) >= k:
                    continue
                tracker = self._tracker(name, fresh=name not in relayed)
                for step, values in points:
                    tracker.log(step, values)
                if summary:
                    tracker.log(k * dl.sync_every, summary)
                if table:
                    tracker.table(k * dl.sync_every, "completions", series.COMPLETION_COLUMNS, table)
                tracker.flush()
                relayed[name] = k
            logged += len(points)
            self._run.put(layout.TRACKING_RELAYED, json.dumps(relayed, sort_keys=True).encode())
            self._lease()
        self._copy_event_files()
        return logged

    def close(self) -> None:
        """Close the tracker runs (waiting for their clients to write) and give the lease up."""
        trackers, self._trackers = self._trackers, {}
        for tracker in trackers.values():
            tracker.close()
        self._copy_event_files(trackers.values())
        if self._held and self._lease_holder() == self._owner:
            self._run.delete(layout.TRACKING_LEASE)
        self._held = False

    def _tracker(self, name: str, *, fresh: bool) -> Tracker:
        if name not in self._trackers:
            tracking = self._config.tracking
            directory = Path(tracking.dir) / (self._config.run_id or "run")
            config = self._config.model_dump(mode="json")
            tracker = open_tracker(name, tracking, self._config.run_id or "run", config, directory)
            if fresh:
                tracker.log_config()
            self._trackers[name] = tracker
        return self._trackers[name]

    def _relayed(self) -> dict[str, int]:
        if not self._run.exists(layout.TRACKING_RELAYED):
            return {}
        return {str(k): int(v) for k, v in json.loads(self._run.get(layout.TRACKING_RELAYED)).items()}

    def _rows_from(self, start: int) -> dict[int, list[dict[str, Any]]]:
        """Every replica's rows of rounds ``start`` on (a listing per replica, a read per row)."""
        rows: dict[int, list[dict[str, Any]]] = {}
        for rank_name in self._run.list(layout.METRICS):
            rank = int(rank_name)
            for name in self._run.list(layout.metrics_dir(rank)):
                match = _ROW_NAME.match(name)
                if match and int(match.group(1)) >= start:
                    row = json.loads(self._run.get(layout.metrics(rank, int(match.group(1)))))
                    rows.setdefault(rank, []).append(row)
        return rows

    def _lease_holder(self) -> str | None:
        if not self._run.exists(layout.TRACKING_LEASE):
            return None
        lease = json.loads(self._run.get(layout.TRACKING_LEASE))
        return lease["owner"] if lease["until"] > time.time() else None

    def _lease(self) -> bool:
        """Take or renew the lease; False while another relay holds it."""
        holder = self._lease_holder()
        if holder not in (None, self._owner):
            if not self._held:
                logger.info("another relay (the launcher watching the run) logs its metrics; leaving it")
            return False
        lease = {"owner": self._owner, "until": time.time() + LEASE_S}
        self._run.put(layout.TRACKING_LEASE, json.dumps(lease).encode())
        self._held = True
        return True

    def _copy_event_files(self, trackers: Any = None) -> None:
        """TensorBoard's event files into the store, so ``tensorboard --logdir`` on the run finds them."""
        for tracker in trackers if trackers is not None else self._trackers.values():
            if isinstance(tracker, TensorBoardTracker):
                for path in sorted(tracker.directory.iterdir()):
                    self._run.put(f"{layout.TRACKING_TENSORBOARD}/{path.name}", path.read_bytes())
