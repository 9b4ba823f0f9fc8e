"""The relay: the launcher (while it watches) and ``status`` (whenever it is run) carry the run's metrics from
the store to its trackers, catching up on whatever nobody relayed before.

Why a relay, not replicas logging themselves: the replicas already write every step to the store (one row per
round, ``replicas/meter.py``), so the relay costs them nothing, while a tracker client in each replica would
cost each one its start-up and a service process beside training, need the tracker's key as one more secret
on every replica, and give N writers to one tracker run, which trackio and TensorBoard do not support
(``benchmarks/tracking.py`` measures the costs). What a relay gives up, it gets back from the store: a run
nobody watches (a detached launcher, a closed laptop) keeps its metrics there, and the next relay logs them.

Exactly once, with any number of relays at once and no clock but the store's:

* **A claim per round.** Before it logs round k to a tracker, a relay creates that tracker's claim for k
  (``tracking/relayed/{tracker}/{k}.json``, create-if-absent), going on from the newest claim (the cursor);
  the relay whose create wins logs the round, and one whose create loses has been overtaken by another relay
  and stops at once. Claims are never rewritten or removed, so the cursor only moves forward, and however the
  relays interleave (one held still mid-round while another takes over), no round reaches a tracker twice.
* **A lease, so that one relay logs at a time.** The lease is a sequence of generations
  (``tracking/lease/{g}.json``), each created once: a relay takes it by creating the generation after the
  newest, when the newest was given up or has lapsed, and renews it (rewrites its own generation) before each
  round. It has lapsed when the store's clock says so: the newest generation was last written more than
  ``LEASE_S`` before an object the taker writes now, both timed by the store, so clocks of different machines
  are never compared. A relay that finds a newer generation than its own has lost the lease: it stops at once
  and writes nothing more. Giving the lease up is creating the next generation, marked free. A generation also
  names its relay's process (host, boot, pid, start time): a relay on the same machine takes over at once from
  one whose process is gone (a launcher killed, then resumed), instead of leaving the trackers ``LEASE_S``
  behind; from another machine only the store's clock decides.

The rule this buys: a step never reaches a tracker twice. A relay killed (or whose tracker failed) after it
claimed a round and before that tracker had the round leaves the round claimed: no relay logs it to that
tracker again, and the store keeps its rows (the report and plots have them). A round the run redoes after a
rollback keeps its first values in the trackers; the store holds the redone ones.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import socket
from pathlib import Path
from typing import Any

import psutil

from composer_serverless.config import RunConfig
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.tracking import series
from composer_serverless.tracking.trackers import TensorBoardTracker, Tracker, open_tracker

logger = logging.getLogger(__name__)

# How long a relay's lease lasts unless renewed: longer than any pause between two of its passes.
LEASE_S = 120.0
# A row, a claim or a lease generation: a number, zero-padded, then .json.
_NUMBERED = re.compile(r"^(\d+)\.json$")


class Relay:
    """Relays one run's rounds to the trackers its config names (``tracking.report_to``)."""

    def __init__(self, run: ObjectStore, config: RunConfig) -> None:
        self._run = run
        self._config = config
        self._names = list(config.tracking.report_to)
        self._owner = secrets.token_hex(8)
        self._trackers: dict[str, Tracker] = {}
        # The lease generation this relay holds; None while it holds none.
        self._generation: int | None = None
        self._told = False

    def open(self) -> None:
        """Open every tracker run now (W&B takes a second or so to start its service), not at the first round
        to relay: a watch that opens them before it starts watching is never held up by it later."""
        for name in self._names:
            self._tracker(name)

    def catch_up(self, *, ended: bool) -> int:
        """Log every round that is ready and not yet relayed; returns the steps of the rounds it logged (to
        any tracker), 0 when another relay holds the lease. ``ended``: the run succeeded, so every round is as
        complete as it will be."""
        if not self._names or not self._hold_lease():
            return 0
        cursor = cursors(self._run, self._names)
        start = min(cursor.values()) + 1
        rows = self._rows_from(start)
        dl = self._config.diloco
        decoupled = dl.mode == "decoupled"
        carried = {rank: series.contribution_steps(replica_rows) for rank, replica_rows in rows.items()}
        logged = 0
        for k in range(start, dl.rounds + 1):
            if decoupled:  # its rounds are versions: their steps are the merged contributions' (``series``)
                merged = self._merged(k, rows, carried) if k > 0 else []
                ready = series.merged_ready(rows, carried, k, merged, ended=ended)
            else:
                ready = series.ready(rows, k, ended=ended)
            if not ready or k > start and not self._renew():
                break
            this = series.round_rows(rows, k)
            if k == 0:
                points = []
            elif decoupled:
                points = series.merged_step_points(carried, merged or [], k, dl.sync_every)
            else:
                points = series.step_points(this, k, dl.sync_every)
            summary = series.round_point(this)
            table = series.completions(this, k)
            behind = [name for name in self._names if cursor[name] < k]
            claimed = self._claim_round(k, behind)
            for name in claimed:
                tracker = self._tracker(name)
                if k == 0:  # the tracker's first round: its run is new
                    tracker.log_config()
                for step, values in points:
                    tracker.log(step, values)
                if summary:
                    tracker.log(k * dl.sync_every, summary)
                if table:
                    tracker.table(k * dl.sync_every, "completions", series.COMPLETION_COLUMNS, table)
                tracker.flush()
                cursor[name] = k
            logged += len(points) if claimed else 0
            if len(claimed) < len(behind):
                break  # overtaken: the round's other trackers are the other relay's
        self._copy_event_files()
        return logged

    def close(self) -> None:
        """Close the tracker runs (waiting for their clients to write) and give the lease up, if still held."""
        trackers, self._trackers = self._trackers, {}
        for tracker in trackers.values():
            tracker.close()
        self._copy_event_files(trackers.values())
        if self._generation is not None and not _overtaken(self._run, self._generation):
            given_up = {"owner": None, "given_up_by": self._owner}
            self._run.create(layout.tracking_lease(self._generation + 1), json.dumps(given_up).encode())
        self._generation = None

    def _tracker(self, name: str) -> Tracker:
        if name not in self._trackers:
            tracking = self._config.tracking
            directory = Path(tracking.dir) / (self._config.run_id or "run")
            config = self._config.model_dump(mode="json")
            self._trackers[name] = open_tracker(
                name, tracking, self._config.run_id or "run", config, directory
            )
        return self._trackers[name]

    def _rows_from(self, start: int) -> dict[int, list[dict[str, Any]]]:
        """Every replica's rows of rounds ``start`` on (a listing per replica, a read per row)."""
        rows: dict[int, list[dict[str, Any]]] = {}
        for rank_name in self._run.list(layout.METRICS):
            rank = int(rank_name)
            for name in self._run.list(layout.metrics_dir(rank)):
                match = _NUMBERED.match(name)
                if match and int(match.group(1)) >= start:
                    row = json.loads(self._run.get(layout.metrics(rank, int(match.group(1)))))
                    rows.setdefault(rank, []).append(row)
        return rows

    def _merged(
        self, k: int, rows: dict[int, list[dict[str, Any]]], carried: dict[int, dict[int, Any]]
    ) -> list[list[int]] | None:
        """Decoupled version ``k``'s merged contributions (its record's ``[learner, seq]`` pairs; None while
        it is not committed), with the rows that carry them read into ``rows`` and ``carried``: a learner that
        sent again before it saw a merge carries a contribution in the row of an earlier version, which may be
        one the relay logged already (before ``rows``' oldest)."""
        try:
            merged = json.loads(self._run.get(layout.version(k)))["merged"]
        except FileNotFoundError:
            return None
        for learner, seq in merged:
            if seq not in carried.get(learner, {}):
                older = self._read_back(rows.setdefault(learner, []), learner, seq)
                carried[learner] = {**series.contribution_steps(older), **carried.get(learner, {})}
        return merged

    def _read_back(self, held: list[dict[str, Any]], learner: int, seq: int) -> list[dict[str, Any]]:
        """Learner ``learner``'s rows older than those ``held``, newest first, until one names contribution
        ``seq`` or only older ones (a learner's contributions only grow: none older can); put at the front
        of ``held``, and returned."""
        oldest = min((row["round"] for row in held), default=None)
        names = self._run.list(layout.metrics_dir(learner))
        numbers = [int(m.group(1)) for m in map(_NUMBERED.match, names) if m]
        older: list[dict[str, Any]] = []
        for number in sorted((n for n in numbers if n >= 1 and (oldest is None or n < oldest)), reverse=True):
            row = json.loads(self._run.get(layout.metrics(learner, number)))
            older.insert(0, row)
            sent = row.get("contributions") or []
            if sent and (seq in sent or max(sent) < seq):
                break
        held[:0] = older
        return older

    def _claim_round(self, k: int, names: list[str]) -> list[str]:
        """Claim round ``k`` of each tracker in ``names``, every claim before any logging, so that a round goes
        to one relay whole; the trackers claimed, fewer than ``names`` when another relay got there first."""
        claimed: list[str] = []
        for name in names:
            if not self._claim(name, k):
                break
            claimed.append(name)
        return claimed

    def _claim(self, name: str, k: int) -> bool:
        """Claim round ``k`` of tracker ``name`` for this relay; False (and the lease dropped) when another
        relay claimed it first: that one relays now, and this one stops."""
        claim = {"owner": self._owner, "lease": self._generation}
        if self._run.create(layout.tracking_claim(name, k), json.dumps(claim).encode()):
            return True
        logger.warning("another relay claimed round %d of %s first; this relay stops", k, name)
        self._generation = None
        return False

    def _hold_lease(self) -> bool:
        """Renew the lease this relay holds, or take it if it is free or has lapsed; False while another
        relay holds it."""
        if self._generation is not None:
            return self._renew()
        newest = _newest_generation(self._run)
        if newest > 0:
            lease = json.loads(self._run.get(layout.tracking_lease(newest)))
            if lease["owner"] is not None and not _gone(lease) and not self._lapsed(newest):
                if not self._told:
                    logger.info("another relay (the launcher watching the run) logs its metrics; leaving it")
                    self._told = True
                return False
        if not self._run.create(layout.tracking_lease(newest + 1), self._lease_body()):
            return False  # another relay took it at the same moment
        self._generation = newest + 1
        return True

    def _renew(self) -> bool:
        """Rewrite this relay's generation (the store times it anew); False, and the lease dropped, when a
        newer generation exists: another relay took over while this one was silent past ``LEASE_S``."""
        generation = self._generation
        if generation is None:
            return False
        self._run.put(layout.tracking_lease(generation), self._lease_body())
        if not _overtaken(self._run, generation):
            return True
        logger.warning(
            "another relay took the relay lease over (this one was silent too long); this one stops"
        )
        self._generation = None
        return False

    def _lease_body(self) -> bytes:
        return json.dumps({"owner": self._owner, "process": _this_process()}).encode()

    def _lapsed(self, generation: int) -> bool:
        """Whether generation ``generation`` was last renewed more than ``LEASE_S`` ago by the store's clock:
        against an object this relay writes now, timed by the same store."""
        clock = layout.tracking_clock(self._owner)
        self._run.put(clock, self._owner.encode())
        try:
            now = self._run.modified(clock)
        finally:
            self._run.delete(clock)
        return now - self._run.modified(layout.tracking_lease(generation)) > LEASE_S

    def _copy_event_files(self, trackers: Any = None) -> None:
        """TensorBoard's event files into the store, so ``tensorboard --logdir`` on the run finds them."""
        for tracker in trackers if trackers is not None else self._trackers.values():
            if isinstance(tracker, TensorBoardTracker):
                for path in sorted(tracker.directory.iterdir()):
                    self._run.put(f"{layout.TRACKING_TENSORBOARD}/{path.name}", path.read_bytes())


def cursors(run: ObjectStore, names: list[str]) -> dict[str, int]:
    """Per tracker, the last round a relay claimed for it (-1: none yet): its newest claim."""
    return {name: _newest(run.list(f"{layout.TRACKING_RELAYED}/{name}"), default=-1) for name in names}


def holder(run: ObjectStore) -> str | None:
    """The relay named by the newest generation of the lease (whether or not it has lapsed); None when no
    relay ever took it or the last one gave it up."""
    newest = _newest_generation(run)
    return json.loads(run.get(layout.tracking_lease(newest)))["owner"] if newest else None


def _this_process() -> dict[str, Any]:
    """What names this process on any machine: its host and boot, its pid and its start time."""
    return {
        "host": socket.gethostname(),
        "boot_time": round(psutil.boot_time()),
        "pid": os.getpid(),
        "create_time": psutil.Process().create_time(),
    }


def _gone(lease: dict[str, Any]) -> bool:
    """Whether the relay holding ``lease`` ran on this machine (same host, same boot) in a process that has
    ended: its pid is gone, or belongs to a process started at another time. Unknown elsewhere: False."""
    held_by, here = lease.get("process"), _this_process()
    if held_by is None or (held_by["host"], held_by["boot_time"]) != (here["host"], here["boot_time"]):
        return False
    try:
        return psutil.Process(held_by["pid"]).create_time() != held_by["create_time"]
    except psutil.NoSuchProcess:
        return True


def _overtaken(run: ObjectStore, generation: int) -> bool:
    """Whether a relay took the lease over from (or after) generation ``generation``."""
    return run.exists(layout.tracking_lease(generation + 1))


def _newest_generation(run: ObjectStore) -> int:
    return _newest(run.list(layout.TRACKING_LEASE), default=0)


def _newest(names: list[str], *, default: int) -> int:
    numbers = [int(m.group(1)) for m in map(_NUMBERED.match, names) if m]
    return max(numbers, default=default)
