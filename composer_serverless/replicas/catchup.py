"""Keeping up with the store: noticing that the run has gone on without this replica, and waiting for the
round in progress to be published, so that a replica that fell behind rejoins in step with the others.

A lag does not shrink by itself (every replica trains at the same pace), so a replica that is late for a
round's quorum would otherwise take the average without contributing, every round, for the rest of the run.
Global states are published only every ``checkpoint_every`` rounds (they cost bytes), so a replica that needs
one asks for it: it writes a heal request, and the next round's publisher publishes its state. When nobody
is left to publish it (every replica died at once), the wait ends at once and the run rolls back
(``recovery.py``).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from composer_serverless.rendezvous import layout, recovery
from composer_serverless.rendezvous.latest import fixed_participants, latest_round, newest_round
from composer_serverless.rendezvous.polling import poll_until
from composer_serverless.rendezvous.store import ObjectStore

# Longest pause between polls of the store while waiting for a round to be published.
WAIT_POLL_CAP_S = 0.25
# How often a waiting replica looks at who may still hold the round (a listing and a read per replica).
HOLDERS_CHECK_S = 2.0


def left_out_of(store: ObjectStore, round_index: int, rank: int, replicas: int) -> bool:
    """Whether ``round_index`` already has a quorum (of its first fragment) that does not include ``rank``."""
    participants = fixed_participants(store, round_index, 0, replicas)
    return participants is not None and rank not in participants


def behind(store: ObjectStore, upcoming: int) -> int:
    """The round the run is already in when this replica is about to start ``upcoming``; ``upcoming`` when it
    is not ahead (a replica that restarted from an older checkpoint finds it far ahead)."""
    return max(upcoming, newest_round(store))


@dataclass(frozen=True)
class Waited:
    """How a wait for a round ended: ``published`` (the latest round then), ``stranded`` (no live replica
    holds it: the run must roll back), ``rolled_back`` (another replica rolled the run back meanwhile), or
    ``timed_out`` with the replicas that might still have published it."""

    published: int | None = None
    stranded: bool = False
    rolled_back: bool = False
    holders: tuple[int, ...] = ()

    @property
    def timed_out(self) -> bool:
        return self.published is None and not self.stranded and not self.rolled_back


def wait_for_round(
    store: ObjectStore,
    round_index: int,
    rank: int,
    replicas: int,
    epoch: int,
    timeout_s: float,
    on_wait: Callable[[], None],
) -> Waited:
    """Ask for ``round_index`` to be published (a heal request) and wait, at most ``timeout_s``, until it is,
    until the run is found stranded (no replica but this one may hold it, ``recovery.holders``, looked at
    every ``HOLDERS_CHECK_S``), or until the run's rollback epoch moves past ``epoch``; ``on_wait`` is called
    at every poll, and first of all, before the request is written: ``on_wait`` beats ``recovery.WAITING``,
    without which the request does not count (``recovery.waiting``)."""
    on_wait()
    store.put(layout.heal_request(rank), json.dumps({"rank": rank, "round": round_index}).encode())
    holders: list[int] = list(range(replicas))
    looked_at = -math.inf

    def settled() -> Waited | None:
        nonlocal holders, looked_at
        latest = latest_round(store)
        if latest >= round_index:
            return Waited(published=latest)
        if recovery.epoch(store) != epoch:
            return Waited(rolled_back=True)
        if time.monotonic() - looked_at >= HOLDERS_CHECK_S:
            looked_at = time.monotonic()
            holders = recovery.holders(store, rank, replicas)
            if not holders:
                return Waited(stranded=True)
        on_wait()
        return None

    try:
        waited = poll_until(settled, time.monotonic() + timeout_s, first_s=0.01, cap_s=WAIT_POLL_CAP_S)
    finally:
        store.delete(layout.heal_request(rank))
    return waited or Waited(holders=tuple(holders))


def heal_requested(store: ObjectStore, round_index: int) -> bool:
    """Whether a replica waits for the state of ``round_index`` or of an earlier round (``recovery.waiting``:
    a request left behind by a replica that no longer waits costs no upload)."""
    return any(asked <= round_index for asked in recovery.waiting(store).values())
