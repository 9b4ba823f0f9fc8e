"""Keeping up with the store: noticing that the run has gone on without this replica, and waiting for the
round in progress to be published, so that a replica that fell behind rejoins in step with the others.

A lag does not shrink by itself (every replica trains at the same pace), so a replica that is late for a
round's quorum would otherwise take the average without contributing, every round, for the rest of the run.
Global states are published only every ``checkpoint_every`` rounds (they cost bytes), so a replica that needs
one asks for it: it writes a heal request, and the next round's publisher publishes its state.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.latest import fixed_participants, latest_round, newest_round
from composer_serverless.rendezvous.polling import poll_until
from composer_serverless.rendezvous.store import ObjectStore

# Longest pause between polls of the store while waiting for a round to be published.
WAIT_POLL_CAP_S = 0.25


def left_out_of(store: ObjectStore, round_index: int, rank: int, replicas: int) -> bool:
    """Whether ``round_index`` already has a quorum (of its first fragment) that does not include ``rank``."""
    participants = fixed_participants(store, round_index, 0, replicas)
    return participants is not None and rank not in participants


def behind(store: ObjectStore, upcoming: int) -> int:
    """The round the run is already in when this replica is about to start ``upcoming``; ``upcoming`` when it
    is not ahead (a replica that restarted from an older checkpoint finds it far ahead)."""
    return max(upcoming, newest_round(store))


def wait_for_round(
    store: ObjectStore, round_index: int, rank: int, timeout_s: float, on_wait: Callable[[], None]
) -> int | None:
    """Ask for ``round_index`` to be published (a heal request) and wait (at most ``timeout_s``) until it is,
    calling ``on_wait`` at every poll; the latest published round then, or None if it did not come in time."""
    store.put(layout.heal_request(rank), json.dumps({"rank": rank, "round": round_index}).encode())

    def published() -> int | None:
        latest = latest_round(store)
        if latest >= round_index:
            return latest
        on_wait()
        return None

    try:
        return poll_until(published, time.monotonic() + timeout_s, first_s=0.01, cap_s=WAIT_POLL_CAP_S)
    finally:
        store.delete(layout.heal_request(rank))


def heal_requested(store: ObjectStore, round_index: int) -> bool:
    """Whether a replica waits for the state of ``round_index`` or of an earlier round."""
    for name in store.list(layout.HEAL):
        try:
            request = json.loads(store.get(f"{layout.HEAL}/{name}"))
        except (FileNotFoundError, ValueError):
            continue  # withdrawn meanwhile, or not ours to read
        if (
            isinstance(request, dict)
            and isinstance(request.get("round"), int)
            and request["round"] <= round_index
        ):
            return True
    return False
