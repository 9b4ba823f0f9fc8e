"""Keeping up with the store: noticing that the run has gone on without this replica, and waiting for the
round in progress to be published, so that a replica that fell behind rejoins in step with the others.

A lag does not shrink by itself (every replica trains at the same pace), so a replica that is late for a
round's quorum would otherwise take the average without contributing, every round, for the rest of the run.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.latest import latest_round
from composer_serverless.rendezvous.polling import poll_until
from composer_serverless.rendezvous.store import ObjectStore

# Longest pause between polls of the store while waiting for a round to be published.
WAIT_POLL_CAP_S = 0.25


def left_out_of(store: ObjectStore, round_index: int, rank: int) -> bool:
    """Whether ``round_index`` already has a quorum (of its first fragment) that does not include ``rank``."""
    try:
        quorum = json.loads(store.get(layout.quorum(round_index, 0)))
    except FileNotFoundError:
        return False
    return rank not in quorum.get("participants", [])


def wait_for_round(
    store: ObjectStore, round_index: int, timeout_s: float, on_wait: Callable[[], None]
) -> int | None:
    """Wait (at most ``timeout_s``) until ``round_index`` is published, calling ``on_wait`` at every poll;
    the latest published round then, or None if it did not come in time."""

    def published() -> int | None:
        latest = latest_round(store)
        if latest >= round_index:
            return latest
        on_wait()
        return None

    return poll_until(published, time.monotonic() + timeout_s, first_s=0.01, cap_s=WAIT_POLL_CAP_S)
