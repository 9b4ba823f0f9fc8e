"""When the pairs of a live harvest are taken: a fixed schedule, decided once in the store for every replica.

The pairs made of round k's rollouts are taken by every replica at the end of round k + L (L =
``harvest.live_lag``) and replayed from round k + L + 1 on; rounds after ``rounds - L - 1`` are not harvested
(no round would replay them). At the end of round j a replica waits, polling the store and saying in its
heartbeat what it waits for, for the launcher's report of the harvest of round j - L (``harvest_report``,
written after the pairs), until one of these:

* the report is there: its pairs file is taken, or nothing when it made none (the cap was spent, the teachers
  agreed on nothing, it failed);
* ``harvest.live_wait_s`` has passed: nothing is taken;
* the launcher's harvester says it stopped (``layout.HARVESTER``: its watch ended, a detach included), or its
  heartbeat has not changed for ``SILENT_S`` (the launcher died, or none ever harvested): nothing is taken.
  Silence is a heartbeat that stopped changing, timed on this replica's own clock, so the launcher's clock and
  the replica's need not agree; and it is remembered from one round to the next (``HarvesterWatch``), so a
  dead launcher costs a replica one ``SILENT_S``, not one per round.

Whatever a replica concludes, it writes it to ``harvest_taken(j)`` with create-if-absent and takes what that
object says, its own conclusion or an earlier one's. So every replica takes the same files at the same round
even when one gave up an instant before the report came to another, as the quorum of a sync is fixed once
(``rendezvous/allreduce.py``). A file not taken at its round is never taken later.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.polling import poll_until
from composer_serverless.rendezvous.store import ObjectStore

logger = logging.getLogger(__name__)

# The launcher's harvester beats every few seconds (``harvest/live.py``); a heartbeat unchanged this long means
# it is gone. Long enough for a store that is slow for a while, short against a round of a real run.
SILENT_S = 60.0

# Why a round boundary took what it took (``Taken.outcome``).
PAIRS, NO_PAIRS, TIMED_OUT, STOPPED, SILENT = (
    "pairs",
    "no pairs",
    "timed out",
    "harvester stopped",
    "harvester silent",
)
OUTCOMES = (PAIRS, NO_PAIRS, TIMED_OUT, STOPPED, SILENT)


def last_harvested(rounds: int, lag: int) -> int:
    """The last round whose rollouts are harvested: a later one's pairs would be replayed by no round."""
    return rounds - lag - 1


def harvest_taken_at(round_end: int, lag: int, rounds: int) -> int | None:
    """The round whose harvest the replicas take at the end of round ``round_end``; None if none is."""
    k = round_end - lag
    return k if 1 <= k <= last_harvested(rounds, lag) else None


@dataclass(frozen=True)
class Taken:
    """What the end of round ``round`` took: the pairs of the harvest of round ``harvest_of``, or nothing.

    Attributes:
        take: whether the harvest's pairs file is taken (``files``).
        outcome: one of ``OUTCOMES``; ``detail`` says more (the report's reason, the harvester's).
        decided_by: the rank of the replica that decided, for every replica.
    """

    round: int
    harvest_of: int
    take: bool
    outcome: str
    detail: str
    decided_by: int

    @property
    def files(self) -> list[str]:
        """The pair files taken, as keys in the run (derived, never read from the store)."""
        return [layout.harvested_pairs(self.harvest_of)] if self.take else []

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    def row(self, waited_s: float) -> dict[str, Any]:
        """The fields of the round's metrics row: what was decided, and how long this replica waited."""
        return {
            "harvest_wait_s": round(waited_s, 3),
            "harvest": {
                "of_round": self.harvest_of,
                "outcome": self.outcome,
                "detail": self.detail,
                "decided_by": self.decided_by,
            },
        }


def parse_taken(raw: bytes, round_end: int, harvest_of: int) -> Taken:
    """A decision read from the store. A malformed one takes nothing: every replica reads the same bytes, so
    every replica takes the same nothing."""
    try:
        doc = json.loads(raw)
        taken = Taken(
            round=round_end,
            harvest_of=harvest_of,
            take=doc["take"] is True,
            outcome=doc["outcome"] if doc["outcome"] in OUTCOMES else NO_PAIRS,
            detail=str(doc["detail"]),
            decided_by=int(doc["decided_by"]),
        )
    except (ValueError, TypeError, KeyError) as e:
        logger.warning("%s is malformed (%s): nothing is taken there", layout.harvest_taken(round_end), e)
        return Taken(round_end, harvest_of, False, NO_PAIRS, "the decision in the store is malformed", -1)
    return taken


def read_taken(run: ObjectStore, round_end: int, harvest_of: int) -> Taken | None:
    """The decision of round ``round_end``'s end, if one was made."""
    try:
        return parse_taken(run.get(layout.harvest_taken(round_end)), round_end, harvest_of)
    except FileNotFoundError:
        return None


def read_report(run: ObjectStore, harvest_of: int) -> dict[str, Any] | None:
    """The launcher's report of the harvest of round ``harvest_of``, once written; one that is not a JSON
    object is read as a failed harvest (no pairs), the same for every replica."""
    try:
        raw = run.get(layout.harvest_report(harvest_of))
    except FileNotFoundError:
        return None
    try:
        report = json.loads(raw)
    except ValueError:
        report = None
    return report if isinstance(report, dict) else {"failed": "its report in the store is malformed"}


def from_report(report: dict[str, Any], round_end: int, harvest_of: int, rank: int) -> Taken:
    """The decision a harvest's report makes: its pairs, or nothing and why."""
    if report.get("pairs_file") == layout.harvested_pairs(harvest_of) and report.get("pairs", 0) > 0:
        return Taken(round_end, harvest_of, True, PAIRS, f"{report['pairs']} pairs", rank)
    why = report.get("skipped") or report.get("failed") or report.get("cancelled")
    if not why:
        why = f"{report.get('prompts', 0)} prompts asked, no pair made"
        if report.get("refused"):
            why += f" ({report['refused']} requests refused by the cap)"
    return Taken(round_end, harvest_of, False, NO_PAIRS, str(why), rank)


class HarvesterWatch:
    """What this replica has seen of the launcher's harvester: its last heartbeat and when it last changed, on
    this replica's monotonic clock. Kept for the replica's life, so silence carries over from round to round."""

    def __init__(
        self, run: ObjectStore, silent_s: float = SILENT_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._run = run
        self.silent_s = silent_s
        self._clock = clock
        self._last: bytes | None = None
        self._changed_at: float | None = None

    def gone(self) -> tuple[str, str] | None:
        """(outcome, why) if the harvester harvests no more; None while it may."""
        try:
            raw: bytes | None = self._run.get(layout.HARVESTER)
        except FileNotFoundError:
            raw = None
        now = self._clock()
        if self._changed_at is None or raw != self._last:
            self._last, self._changed_at = raw, now
        if raw is not None:
            try:
                beat = json.loads(raw)
            except ValueError:
                beat = None
            if isinstance(beat, dict) and beat.get("state") == "stopped":
                return STOPPED, f"the launcher's harvester stopped: {beat.get('reason', 'no reason given')}"
        silent = now - self._changed_at
        if silent >= self.silent_s:
            heard = "no heartbeat" if raw is None else "an unchanged heartbeat"
            return SILENT, f"{heard} from the launcher's harvester for {silent:.0f}s (launcher gone?)"
        return None


def decide(
    run: ObjectStore,
    round_end: int,
    harvest_of: int,
    rank: int,
    wait_s: float,
    watch: HarvesterWatch,
    waiting: Callable[[str], None],
) -> tuple[Taken, float]:
    """What the end of round ``round_end`` takes (see the module), and the seconds this replica waited.

    ``waiting`` is called at every look that finds nothing decided yet, with what the replica waits for."""
    started = time.monotonic()
    deadline = started + wait_s
    what = f"waiting for the harvest of round {harvest_of}"

    def settled() -> Taken | None:
        existing = read_taken(run, round_end, harvest_of)
        if existing is not None:
            return existing
        report = read_report(run, harvest_of)
        if report is not None:
            return _create(run, from_report(report, round_end, harvest_of, rank))
        gone = watch.gone()
        if gone is not None:
            return _create(run, Taken(round_end, harvest_of, False, gone[0], gone[1], rank))
        if time.monotonic() >= deadline:
            return None
        waiting(what)
        return None

    # Looks as often as every wait for the store does (at most 0.5 s apart, three small reads each): the
    # replicas leave together, in step for the next sync.
    taken = poll_until(settled, deadline)
    if taken is None:
        detail = f"no report within harvest.live_wait_s = {wait_s:g}s"
        taken = _create(run, Taken(round_end, harvest_of, False, TIMED_OUT, detail, rank))
    waited = time.monotonic() - started
    if taken.decided_by == rank:
        logger.info(
            "round %d takes %s: %s (%s)", round_end, taken.files or "nothing", taken.outcome, taken.detail
        )
    return taken, waited


def _create(run: ObjectStore, taken: Taken) -> Taken:
    """Record ``taken`` unless another replica decided first; the decision that stands."""
    key = layout.harvest_taken(taken.round)
    if run.create(key, taken.to_json()):
        return taken
    return parse_taken(run.get(key), taken.round, taken.harvest_of)
