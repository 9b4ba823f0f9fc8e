"""The live harvest's schedule on the replica side: which harvest each round boundary takes, the wait for it,
and the decision made once in the store for every replica, whoever decides and however they race."""

from __future__ import annotations

import json
import threading

import pytest

from composer_serverless.objectives import harvest_schedule as schedule
from composer_serverless.objectives.harvest_schedule import (
    NO_PAIRS,
    PAIRS,
    SILENT,
    STOPPED,
    TIMED_OUT,
    HarvesterWatch,
    decide,
    from_report,
    harvest_taken_at,
)
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import ObjectStore

LONG_S = 60.0  # a wait no test reaches: reaching it fails the test (its outcome would be "timed out")


def _report(run, k, pairs=3, **fields):
    if pairs:
        run.put(layout.harvested_pairs(k), b'{"prompt": "p", "chosen": "a", "rejected": "b"}\n' * pairs)
    doc = {"round": k, "pairs": pairs, "pairs_file": layout.harvested_pairs(k) if pairs else None, **fields}
    run.put(layout.harvest_report(k), json.dumps(doc).encode())


def _beat(run, **fields):
    run.put(layout.HARVESTER, json.dumps(fields).encode())


class Waits:
    """A replica's ``waiting`` callback: records what it said, and sets ``started`` at the first call."""

    def __init__(self):
        self.said: list[str] = []
        self.started = threading.Event()

    def __call__(self, what):
        self.said.append(what)
        self.started.set()


def test_the_schedule_takes_round_k_at_the_end_of_round_k_plus_the_lag():
    def taken(rounds, lag):
        return {j: harvest_taken_at(j, lag, rounds) for j in range(1, rounds + 1)}

    assert taken(6, 1) == {1: None, 2: 1, 3: 2, 4: 3, 5: 4, 6: None}
    assert taken(6, 0) == {1: 1, 2: 2, 3: 3, 4: 4, 5: 5, 6: None}
    assert taken(6, 2) == {1: None, 2: None, 3: 1, 4: 2, 5: 3, 6: None}
    assert taken(3, 1) == {1: None, 2: 1, 3: None}


def test_a_report_already_there_is_taken_without_waiting(tmp_path):
    run = ObjectStore(str(tmp_path))
    _report(run, 1, pairs=3)
    waits = Waits()
    taken, _ = decide(run, 2, 1, 0, LONG_S, HarvesterWatch(run), waits)
    assert (taken.take, taken.outcome, taken.files, taken.decided_by) == (
        True,
        PAIRS,
        [layout.harvested_pairs(1)],
        0,
    )
    assert waits.said == []
    assert json.loads(run.get(layout.harvest_taken(2))) == {
        "round": 2,
        "harvest_of": 1,
        "take": True,
        "outcome": PAIRS,
        "detail": "3 pairs",
        "decided_by": 0,
    }


def test_a_late_harvest_is_waited_for_and_taken_at_its_round(tmp_path):
    """The report comes only once the replica is seen waiting for it (in its heartbeat's words)."""
    run = ObjectStore(str(tmp_path))
    _beat(run, state="harvesting round 1", beat=1)
    waits = Waits()
    result = {}

    def replica():
        result["taken"], result["waited"] = decide(run, 2, 1, 1, LONG_S, HarvesterWatch(run), waits)

    thread = threading.Thread(target=replica)
    thread.start()
    assert waits.started.wait(LONG_S)
    _report(run, 1, pairs=2)
    thread.join(LONG_S)
    assert result["taken"].outcome == PAIRS and result["taken"].files == [layout.harvested_pairs(1)]
    assert set(waits.said) == {"waiting for the harvest of round 1"}
    assert result["waited"] > 0


def test_one_replica_gave_up_so_no_replica_takes_the_file(tmp_path):
    """Replica 0 stops waiting (here at once: live_wait_s = 0) an instant before the report comes; replica 1,
    which would have found the report, takes what replica 0 decided: nothing, at this round or any later."""
    run = ObjectStore(str(tmp_path))
    _beat(run, state="harvesting round 3", beat=7)
    first, _ = decide(run, 4, 3, 0, 0.0, HarvesterWatch(run), Waits())
    assert (first.take, first.outcome, first.decided_by) == (False, TIMED_OUT, 0)
    _report(run, 3, pairs=5)
    second, _ = decide(run, 4, 3, 1, LONG_S, HarvesterWatch(run), Waits())
    assert second == first and second.files == []


@pytest.mark.parametrize("trial", range(12))
def test_racing_replicas_all_take_the_same(tmp_path, trial):
    """Four replicas decide at once while the report lands; one of them does not wait (live_wait_s = 0 is the
    earliest a replica can give up). Whoever wins, every replica takes exactly what the store's decision says."""
    run = ObjectStore(str(tmp_path))
    _beat(run, state="harvesting round 1", beat=1)
    go = threading.Barrier(5)
    results: dict[int, schedule.Taken] = {}

    def replica(rank):
        go.wait()
        wait_s = 0.0 if rank == trial % 4 else LONG_S
        results[rank] = decide(run, 2, 1, rank, wait_s, HarvesterWatch(run), Waits())[0]

    def launcher():
        go.wait()
        _report(run, 1, pairs=4)

    threads = [threading.Thread(target=replica, args=(r,)) for r in range(4)] + [
        threading.Thread(target=launcher)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(LONG_S)
    stored = schedule.parse_taken(run.get(layout.harvest_taken(2)), 2, 1)
    assert len(results) == 4 and all(taken == stored for taken in results.values())
    assert stored.outcome in (PAIRS, TIMED_OUT) and stored.take == (stored.outcome == PAIRS)


def test_a_stopped_harvester_is_not_waited_for(tmp_path):
    run = ObjectStore(str(tmp_path))
    _beat(run, state="stopped", reason="the launcher detached from the run")
    waits = Waits()
    taken, _ = decide(run, 3, 2, 0, LONG_S, HarvesterWatch(run), waits)
    assert (taken.take, taken.outcome) == (False, STOPPED)
    assert taken.detail == "the launcher's harvester stopped: the launcher detached from the run"
    assert waits.said == []


def test_a_silent_harvester_costs_each_replica_one_silence_not_one_per_round(tmp_path):
    """No heartbeat at all (the launcher died before harvesting, or never ran): both replicas stop waiting
    after the silence bound, far before live_wait_s, with one decision; at the next boundary they do not wait."""
    run = ObjectStore(str(tmp_path))
    watches = {rank: HarvesterWatch(run, silent_s=0.2) for rank in (0, 1)}
    results: dict[int, schedule.Taken] = {}

    def replica(rank, round_end, harvest_of):
        results[rank] = decide(run, round_end, harvest_of, rank, LONG_S, watches[rank], Waits())[0]

    threads = [threading.Thread(target=replica, args=(rank, 2, 1)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(LONG_S)
    assert results[0] == results[1] and (results[0].take, results[0].outcome) == (False, SILENT)
    assert results[0].detail.startswith("no heartbeat from the launcher's harvester")

    waits = Waits()
    taken, _ = decide(run, 3, 2, 0, LONG_S, watches[0], waits)
    assert taken.outcome == SILENT and waits.said == []


def test_the_watch_times_silence_as_a_heartbeat_that_stopped_changing(tmp_path):
    """On the replica's own clock: the launcher's clock (its beats' times) is never compared with it."""
    run = ObjectStore(str(tmp_path))
    now = [100.0]
    watch = HarvesterWatch(run, silent_s=60.0, clock=lambda: now[0])
    assert watch.gone() is None  # nothing yet: silence starts now
    now[0] += 59.0
    assert watch.gone() is None
    _beat(run, state="harvesting round 1", beat=1, time=0.0)  # a beat from a clock far behind
    now[0] += 59.0
    assert watch.gone() is None  # it changed 59 s ago
    now[0] += 30.0
    assert watch.gone() is None  # unchanged for 30 s since this replica saw it change
    now[0] += 31.0
    assert watch.gone() == (
        SILENT,
        "an unchanged heartbeat from the launcher's harvester for 61s (launcher gone?)",
    )
    _beat(run, state="harvesting round 2", beat=2, time=0.0)
    assert watch.gone() is None  # beating again (a launch --resume)
    _beat(run, state="stopped", reason="the run ended")
    assert watch.gone() == (STOPPED, "the launcher's harvester stopped: the run ended")


@pytest.mark.parametrize(
    ("report", "detail"),
    [
        ({"pairs": 0, "prompts": 12}, "12 prompts asked, no pair made"),
        (
            {"pairs": 0, "prompts": 12, "refused": 30},
            "12 prompts asked, no pair made (30 requests refused by the cap)",
        ),
        ({"skipped": "the cap of $0.01 is spent"}, "the cap of $0.01 is spent"),
        ({"cancelled": "the launcher stopped watching the run"}, "the launcher stopped watching the run"),
        ({"failed": "RecordError: bad line"}, "RecordError: bad line"),
    ],
)
def test_a_report_without_pairs_takes_nothing_and_says_why(report, detail):
    taken = from_report({"round": 1, **report}, 2, 1, 0)
    assert (taken.take, taken.outcome, taken.detail, taken.files) == (False, NO_PAIRS, detail, [])


def test_a_malformed_decision_takes_nothing_on_every_replica(tmp_path):
    run = ObjectStore(str(tmp_path))
    run.put(layout.harvest_taken(2), b'{"take": "yes please"')
    _report(run, 1, pairs=3)
    for rank in (0, 1):
        taken, _ = decide(run, 2, 1, rank, LONG_S, HarvesterWatch(run), Waits())
        assert (taken.take, taken.files, taken.decided_by) == (False, [], -1)
