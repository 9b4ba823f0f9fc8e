"""The store side of a run that rolls itself back: who may still hold a round, and one rollback per epoch
whoever and however many find the run stranded."""

from __future__ import annotations

import json
import threading

import pytest

from composer_serverless.rendezvous import checkpoint, latest, layout, recovery
from composer_serverless.rendezvous.polling import Clock
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import Reporter
from composer_serverless.replicas import catchup


@pytest.fixture
def store(tmp_path) -> ObjectStore:
    return ObjectStore(f"file://{tmp_path}/run")


def _beat(store: ObjectStore, rank: int, state: str, round_index: int = 4) -> None:
    store.put(
        layout.heartbeat(rank), json.dumps({"rank": rank, "state": state, "round": round_index}).encode()
    )


def test_a_replica_holds_the_round_unless_it_waits_starts_failed_or_finished(store: ObjectStore) -> None:
    """Rank 0 asks. Rank 1 was killed while training (its last heartbeat says so): it may hold the round
    until it is started again. Rank 2 waits (a heal request), 3 is starting, 4 failed, 5 is done, 6 never
    beat."""
    _beat(store, 1, "training")
    _beat(store, 2, "waiting")
    store.put(layout.heal_request(2), b'{"rank": 2, "round": 4}')
    _beat(store, 3, "starting")
    _beat(store, 4, "failed")
    _beat(store, 5, "done")
    assert recovery.holders(store, 0, 7) == [1]
    _beat(store, 1, "starting")  # started again: it holds nothing
    assert recovery.holders(store, 0, 7) == []
    _beat(store, 3, "waiting for the harvest")  # a replica at a round's end waits with its state: it holds it
    assert recovery.holders(store, 0, 7) == [3]


def test_a_heal_request_left_behind_counts_only_while_its_replica_waits(store: ObjectStore) -> None:
    """Rank 1 was killed while it waited for round 4: its request stays. While it is down it holds nothing,
    and the publisher of round 4 publishes for it. Started again and training, with the request still there,
    it holds rounds like any other (a waiter must not find the run stranded and roll it back while it trains),
    and nobody publishes a whole global state every round for a request nobody makes."""
    store.put(layout.heal_request(1), b'{"rank": 1, "round": 4}')
    _beat(store, 1, recovery.WAITING)
    assert recovery.holders(store, 0, 2) == [] and catchup.heal_requested(store, 4)
    assert not catchup.heal_requested(store, 3)  # it waits for round 4: round 3's publisher owes it nothing
    _beat(store, 1, "starting")
    assert recovery.holders(store, 0, 2) == [] and not catchup.heal_requested(store, 4)
    _beat(store, 1, "training", round_index=6)
    assert recovery.holders(store, 0, 2) == [1] and not catchup.heal_requested(store, 6)
    assert recovery.waiting(store) == {}


def test_a_waiting_replica_says_so_before_its_request_is_there(store: ObjectStore) -> None:
    """A request counts only with the heartbeat that says its replica waits, so the heartbeat comes first:
    the publisher that reads the request the moment it lands publishes for it."""
    seen_when_asked: list[bool] = []

    class Watched(ObjectStore):
        def put(self, key: str, data) -> None:
            super().put(key, data)
            if key == layout.heal_request(0):
                seen_when_asked.append(catchup.heal_requested(self, 4))

    watched = Watched(store.url)
    latest.advance(watched, 4, checkpoint=False)  # published already: the wait ends at its first look
    reporter = Reporter(watched, 0)
    waited = catchup.wait_for_round(
        watched, 4, 0, 2, 0, 60.0, lambda: reporter.beat(state=recovery.WAITING, round=4)
    )
    assert waited.published == 4 and seen_when_asked == [True]
    assert not store.exists(layout.heal_request(0))


def _published_checkpoints(store: ObjectStore) -> None:
    for k in (2, 4):
        checkpoint.write_global(store, k, {"step": k})
        checkpoint.advance(store, k, checkpoint=True)
    store.put("rounds/6/0/quorum.json", b'{"participants": [0, 1, 2]}')


def test_many_stranded_replicas_roll_the_run_back_once(store: ObjectStore) -> None:
    """Three replicas find the run stranded at once: one claim wins, the run goes back to checkpoint 4 once,
    and the epoch moves to 1 for all."""
    _published_checkpoints(store)
    done: dict[int, recovery.Rollback | None] = {}
    barrier = threading.Barrier(3)

    def stranded(rank: int) -> None:
        barrier.wait()
        done[rank] = recovery.roll_back(ObjectStore(store.url), 0, 6, rank)

    threads = [threading.Thread(target=stranded, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    made = [r for r in done.values() if r is not None]
    assert len(done) == 3 and len(made) == 1
    assert made[0].waited_for == 6 and made[0].to == 4 and made[0].redone == 1
    assert recovery.epoch(store) == 1 and recovery.rollbacks(store) == made
    assert latest.newest_round(store) == 0 and latest.latest_round(store) == 4


def test_a_late_replica_never_rolls_the_run_back_a_second_time(store: ObjectStore) -> None:
    """After the rollback of epoch 0 the run moves on (round 5 has a quorum); a replica that found it
    stranded back then and asks only now is told the rollback was made, and nothing is deleted."""
    _published_checkpoints(store)
    assert recovery.roll_back(store, 0, 6, rank=0) is not None
    store.put("rounds/5/0/quorum.json", b'{"participants": [0, 1]}')
    assert recovery.roll_back(store, 0, 6, rank=2) is None
    assert latest.newest_round(store) == 5 and recovery.epoch(store) == 1


class FakeClock:
    """A monotonic clock whose pauses pass at once: minutes of waiting in no time, and in order."""

    def __init__(self) -> None:
        self.t = 1000.0

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds

    @property
    def clock(self) -> Clock:
        return Clock(self.now, self.sleep)


def test_a_claimant_that_died_mid_rollback_is_taken_over_once_it_cannot_be_changing_the_store(
    store: ObjectStore,
) -> None:
    """Rank 1 claimed the rollback of epoch 0 and died before making it: rank 0 waits until rank 1's lease
    and the longest store call it could have begun within it are over (past a whole store outage: a claimant
    stuck in retries is not dead), then claims the next generation and rolls back.
    With the defaults that is 60 + 6 x 60 (requests hanging to their timeout) + 11.6 (backoff) + 300 (the
    outage) + 1.5 s."""
    store.tolerate_outages(300.0)
    assert recovery.takeover_after_s(store.retry) == pytest.approx(733.125)
    _published_checkpoints(store)
    store.create(layout.rollback_claim(0, 0), b'{"rank": 1}')
    fake = FakeClock()
    taken_at: list[float] = []

    class Watched(ObjectStore):
        def create(self, key: str, data) -> bool:
            if key == layout.rollback_claim(0, 1):
                taken_at.append(fake.now())
            return super().create(key, data)

    watched = Watched(store.url)
    watched.tolerate_outages(300.0)
    done = recovery.roll_back(watched, 0, 6, rank=0, clock=fake.clock)
    assert done is not None and done.by == 0 and store.exists(layout.rollback_claim(0, 1))
    assert recovery.epoch(store) == 1
    (at,) = taken_at
    assert 733.125 <= at - 1000.0 < 733.125 + 1.5  # the last pause is at most the poll cap


def test_a_claimant_stuck_in_the_store_past_its_lease_changes_nothing_after_the_takeover(
    store: ObjectStore,
) -> None:
    """Two rollbacks at once. Rank 1 claims the rollback of epoch 0; its first delete is refused through a
    300 s store outage (the store's retries hold it). Meanwhile rank 0 takes the claim over, rolls the run back
    to checkpoint 4, and the run moves on: round 5 published, round 6 under way. When rank 1's delete returns,
    its lease is over: it changes nothing more and finds the rollback made. Before, it went on, set LATEST
    back to 4 under the run and moved the epoch a second time."""
    store.tolerate_outages(300.0)
    _published_checkpoints(store)
    fake = FakeClock()
    made: list[recovery.Rollback | None] = []

    class Stuck(ObjectStore):
        def delete(self, key: str) -> None:
            super().delete(key)
            if made:
                return
            fake.sleep(300.0)  # the delete was refused, and retried, for the whole outage
            other = ObjectStore(store.url)
            other.tolerate_outages(300.0)
            made.append(recovery.roll_back(other, 0, 6, rank=0, clock=fake.clock))
            checkpoint.write_global(store, 5, {"step": 5})
            checkpoint.advance(store, 5, checkpoint=False)
            store.put("rounds/6/0/quorum.json", b'{"participants": [0, 1]}')

    stuck = Stuck(store.url)
    stuck.tolerate_outages(300.0)
    assert recovery.roll_back(stuck, 0, 6, rank=1, clock=fake.clock) is None
    (by_rank_0,) = made
    assert by_rank_0 is not None and by_rank_0.by == 0 and by_rank_0.to == 4
    assert recovery.rollbacks(store) == [by_rank_0] and recovery.epoch(store) == 1
    assert latest.latest_round(store) == 5 and latest.newest_round(store) == 6


def test_a_run_with_nothing_intact_cannot_roll_back_and_says_what_to_do(store: ObjectStore) -> None:
    _published_checkpoints(store)
    for k in (2, 4):
        store.delete(f"state/{k}/0/manifest.json")
    with pytest.raises(recovery.RecoveryError, match=r"(?s)cannot roll back.*fix: launch a new run"):
        recovery.roll_back(store, 0, 6, rank=0)


@pytest.mark.parametrize("garbage", [b"\x00\xff", b"[]", b'{"rollbacks": [{"to": 1}]}', b'{"rollbacks": 3}'])
def test_a_garbage_rollback_record_reads_as_none_and_the_next_rollback_rewrites_it(
    store: ObjectStore, garbage: bytes
) -> None:
    store.put(layout.ROLLBACKS, garbage)
    assert recovery.rollbacks(store) == [] and recovery.epoch(store) == 0
    _published_checkpoints(store)
    done = recovery.roll_back(store, 0, 6, rank=0)
    assert recovery.rollbacks(store) == [done] and recovery.epoch(store) == 1
