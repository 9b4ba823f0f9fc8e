"""A run that rolls itself back when the round its replicas wait for can no longer be published.

A replica that restarts finds the run rounds ahead of it and waits for the round in progress to be published
(``catchup.py``): a live replica that holds it publishes it at the end of the round. When every replica died
at once (a zone's spot capacity reclaimed, a bad driver) nobody holds it: every restarted replica waits for
the others. ``stranded`` sees that from the store alone: no replica but the asking one may still publish it
(each other one is waiting too, or starting, or has failed or finished). The replicas then do what
``launch --resume`` does, without anyone's help: the newest intact checkpoint becomes the latest state again
(``latest.roll_back``) and they redo the rounds after it.

One replica rolls the run back for all: each one that finds the run stranded claims the rollback of the
epoch it saw (``layout.rollback_claim``, create-if-absent); the winner rolls back and records it in
``layout.ROLLBACKS`` (whose length is the epoch), the others wait for the epoch to move. Claims are kept, so a
replica that looks late never rolls the run back a second time, past rounds the others have already redone.

A claimant that dies mid-rollback is taken over by the next generation's claim, but never while it may still
be changing the store: a claimant makes changes only for ``ROLLBACK_LEASE_S`` after it claimed (by its own
clock; past it, it stops and claims again), and the others take over only ``takeover_after_s`` after they
first saw the claim: the lease plus the longest one store call can take (``call_bound_s``: every retry of a
request that hangs, and a whole store outage). So two claimants never change the store at once: the epoch
moves by one, and no late delete removes a round the others restarted from. Rolling back is idempotent until a
replica trains again, and none does while a claim of its epoch is open (``claimed``).

Every replica compares the epoch it restored from with the store's at each sync (``epoch``), after it has
read everything else it decides on: one that restored just before a rollback (it was starting) restores
again, and one that finds a rollback of its epoch claimed and not yet made waits for it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from composer_serverless.rendezvous import latest, layout
from composer_serverless.rendezvous.polling import MONOTONIC, Clock, poll_until
from composer_serverless.rendezvous.retry import RetryPolicy
from composer_serverless.rendezvous.store import ObjectStore

logger = logging.getLogger(__name__)

# Heartbeat states in which a replica holds no round the others could need: it has not loaded one yet, or it
# has stopped. A replica that waits for a round says so with its heal request and this state (``waiting``).
NOT_HOLDING = frozenset({"starting", "failed", "done"})
# The heartbeat state of a replica that waits for a round to be published (``catchup.wait_for_round``).
WAITING = "waiting"
# How long after its claim a claimant may change the store: rolling back is a few listings and deletes.
ROLLBACK_LEASE_S = 60.0
# The longest one request may hang before the store's retry loop sees it fail (botocore's read timeout).
REQUEST_TIMEOUT_S = 60.0
MAX_CLAIM_GENERATIONS = 8


class LeaseExpired(RuntimeError):
    """A claimant's ``ROLLBACK_LEASE_S`` ran out before it finished: it must not change the store any more."""


def call_bound_s(retry: RetryPolicy) -> float:
    """The longest one store call can take under ``retry``: every attempt hanging until its request times out,
    each followed by its longest backoff, and a write the store refuses retried for its whole outage."""
    backoff = sum(min(retry.cap_s, retry.first_s * 2**a) * 1.5 for a in range(retry.attempts - 1))
    return retry.attempts * REQUEST_TIMEOUT_S + backoff + retry.outage_s + retry.outage_poll_s * 1.5


def takeover_after_s(retry: RetryPolicy) -> float:
    """How long after first seeing a claim the others take it over: past its claimant's lease and the last
    store call it may have begun within it."""
    return ROLLBACK_LEASE_S + call_bound_s(retry)


class RecoveryError(RuntimeError):
    """The run could not be rolled back: every claimant died mid-rollback, or no state can be resumed."""


@dataclass(frozen=True)
class Rollback:
    """One rollback of the run: the round the replicas waited for, the round they restart after, and which
    states were passed over as damaged."""

    waited_for: int
    to: int
    by: int
    skipped: tuple[str, ...] = ()

    @property
    def redone(self) -> int:
        """Rounds that had been completed and are trained again: those after ``to`` before ``waited_for``."""
        return max(0, self.waited_for - 1 - self.to)


def rollbacks(store: ObjectStore) -> list[Rollback]:
    """The rollbacks the run made by itself, oldest first."""
    try:
        raw = store.get(layout.ROLLBACKS)
    except FileNotFoundError:
        return []
    try:
        return [
            Rollback(int(r["waited_for"]), int(r["to"]), int(r["by"]), tuple(map(str, r.get("skipped", ()))))
            for r in json.loads(raw)["rollbacks"]
        ]
    except (ValueError, KeyError, TypeError, AttributeError):  # garbage: the next rollback rewrites it
        logger.warning(
            "%s is not a rollback record (%r); reading it as none", store.url_of(layout.ROLLBACKS), raw[:80]
        )
        return []


def epoch(store: ObjectStore) -> int:
    """How many times the run rolled itself back: a replica that restored at another epoch restores again."""
    return len(rollbacks(store))


def given_up(store: ObjectStore) -> set[int]:
    """The replicas the launcher gave up on (``layout.given_up``): the run goes on without them."""
    return {r for r in map(_rank_of, store.list(layout.GIVEN_UP)) if r is not None}


def waiting(store: ObjectStore) -> dict[int, int]:
    """The replicas that wait for a round to be published, each with the round it waits for: those with a heal
    request whose heartbeat says they wait, and that the launcher has not given up.

    The request alone does not say it: a replica killed while it waited leaves its request behind, and once
    started again it trains (and holds rounds) with the request still there. A waiting replica beats
    ``WAITING`` before it writes its request, so a request it made is never read without it."""
    absent = given_up(store)
    found: dict[int, int] = {}
    for name in store.list(layout.HEAL):
        rank = _rank_of(name)
        if rank is None or rank in absent:
            continue
        try:
            request = json.loads(store.get(f"{layout.HEAL}/{name}"))
        except (FileNotFoundError, ValueError):
            continue  # withdrawn meanwhile, or not ours to read
        round_index = request.get("round") if isinstance(request, dict) else None
        if not isinstance(round_index, int) or isinstance(round_index, bool):
            continue
        beat = _heartbeat(store, rank)
        if beat is not None and beat.get("state") == WAITING:
            found[rank] = round_index
    return found


def holders(store: ObjectStore, rank: int, replicas: int) -> list[int]:
    """The replicas other than ``rank`` that may still hold the run's round in progress: not waiting for a
    round themselves (``waiting``), nor starting, failed or done by their heartbeat, nor given up by the
    launcher. A replica killed outright keeps its last heartbeat ("training") until it is started again, so it
    counts until then, or until the launcher gives it up (its restart got no hardware)."""
    asking = waiting(store)
    absent = given_up(store)
    found = []
    for other in range(replicas):
        if other == rank or other in asking or other in absent:
            continue
        beat = _heartbeat(store, other)
        if beat is not None and beat.get("state") not in NOT_HOLDING:
            found.append(other)
    return found


def claimed(store: ObjectStore, seen: int) -> bool:
    """Whether a rollback of epoch ``seen`` is claimed: if the epoch is still ``seen``, it is being made (or
    its claimant died and the next one will take over), and nobody may train from the state before it."""
    prefix = f"{seen}-"
    return any(name.startswith(prefix) for name in store.list(layout.RECOVERY))


def roll_back(
    store: ObjectStore,
    seen: int,
    waited_for: int,
    rank: int,
    local_ranks: int = 1,
    *,
    clock: Clock = MONOTONIC,
) -> Rollback | None:
    """Roll the run back from epoch ``seen`` to its newest intact checkpoint, once for every replica that found
    it stranded waiting for ``waited_for``: the rollback this replica made, or None if another one made it.

    Raises:
        RecoveryError: every claimant died mid-rollback, or no state of the run can be resumed.
    """
    takeover_s = takeover_after_s(store.retry)
    for generation in range(MAX_CLAIM_GENERATIONS):
        key = layout.rollback_claim(seen, generation)
        leased_until = (
            clock.now() + ROLLBACK_LEASE_S
        )  # read before the claim exists: never later than its start
        claim = json.dumps({"rank": rank, "waited_for": waited_for, "time": time.time()}).encode()
        if store.create(key, claim):
            if epoch(store) != seen:  # the previous claimant finished after all, just now
                return None
            try:
                return _roll_back(store, waited_for, rank, local_ranks, _lease(clock, leased_until, key))
            except LeaseExpired:
                logger.warning(
                    "replica %d: the store was too slow to roll the run back within %.0f s of claiming it as "
                    "%s; stopped changing it, claiming the next",
                    rank,
                    ROLLBACK_LEASE_S,
                    store.url_of(key),
                )
                continue
        moved = poll_until(
            lambda: True if epoch(store) != seen else None, clock.now() + takeover_s, cap_s=1.0, clock=clock
        )
        if moved:
            return None
        logger.warning(
            "replica %d: the rollback claimed as %s did not finish in %.0f s; claiming the next",
            rank,
            store.url_of(key),
            takeover_s,
        )
    raise RecoveryError(
        f"{store.url}: {MAX_CLAIM_GENERATIONS} replicas claimed the rollback of epoch {seen} and none finished it"
        f"\n  fix: composer-serverless cancel {store.url}, then launch --resume {store.url}"
    )


def _lease(clock: Clock, until: float, key: str) -> Callable[[], None]:
    """What a claimant calls before each change to the store: raises once its lease has run out."""

    def check() -> None:
        if clock.now() >= until:
            raise LeaseExpired(f"the lease of {key} ran out")

    return check


def _roll_back(
    store: ObjectStore, waited_for: int, rank: int, local_ranks: int, before_change: Callable[[], None]
) -> Rollback:
    try:
        back = latest.roll_back(store, local_ranks, before_change)
    except latest.NoIntactState as e:
        raise RecoveryError(
            f"every replica waits for round {waited_for}, which no live replica holds, and the run cannot roll "
            f"back: {e}\n  fix: launch a new run (the model can start from a checkpoint's weights)"
        ) from e
    done = Rollback(waited_for, back.round, rank, back.skipped)
    record = [_as_json(r) for r in rollbacks(store)] + [_as_json(done)]
    before_change()
    store.put(layout.ROLLBACKS, json.dumps({"rollbacks": record}, indent=1).encode())
    return done


def _as_json(rollback: Rollback) -> dict[str, Any]:
    return {
        "waited_for": rollback.waited_for,
        "to": rollback.to,
        "by": rollback.by,
        "skipped": list(rollback.skipped),
        "redone": rollback.redone,
    }


def _heartbeat(store: ObjectStore, rank: int) -> dict[str, Any] | None:
    try:
        beat = json.loads(store.get(layout.heartbeat(rank)))
    except (FileNotFoundError, ValueError):
        return None
    return beat if isinstance(beat, dict) else None


def _rank_of(name: str) -> int | None:
    stem = name.removesuffix(".json")
    return int(stem) if stem.isdigit() else None
