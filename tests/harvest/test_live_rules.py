"""Which round a live harvest takes next, whose rollouts it reads, and what the run has spent: from the
objects in the store."""

from __future__ import annotations

import json
from fractions import Fraction
from types import SimpleNamespace

import pytest

from composer_serverless.config import ConfigError
from composer_serverless.harvest.live import (
    MemberWatch,
    counted_spend,
    harvested_rounds,
    next_round,
    ready_ranks,
)
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import ObjectStore
from tests.harvest.conftest import live_run_config

CONFIG = SimpleNamespace(
    diloco=SimpleNamespace(replicas=3, rounds=6, fragments=2), harvest=SimpleNamespace(live_lag=1)
)
NO_LAG = SimpleNamespace(diloco=CONFIG.diloco, harvest=SimpleNamespace(live_lag=0))


def _rollouts(run, k, *ranks):
    for rank in ranks:
        run.put(layout.rollouts(k, rank), b'{"prompt": "p", "student": "s"}\n')


def _quorum(run, k, *ranks, fragment=1):
    run.put(layout.quorum(k, fragment), json.dumps({"participants": list(ranks)}).encode())


def _beat(run, rank, **fields):
    run.put(layout.heartbeat(rank), json.dumps({"rank": rank, **fields}).encode())


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _watch(run, clock=None):
    return MemberWatch(run, silent_s=60.0, clock=clock or Clock())


def test_every_round_of_the_schedule_in_order_none_passed_over():
    assert next_round(CONFIG, {}) == 1
    assert next_round(CONFIG, {1: {}, 3: {}}) == 2  # a report of 3 does not make 2 stale
    assert next_round(CONFIG, {1: {}, 2: {}, 3: {}}) == 4
    assert next_round(CONFIG, {k: {} for k in (1, 2, 3, 4)}) is None  # 5 = rounds - lag: replayed by none
    lag2 = SimpleNamespace(diloco=CONFIG.diloco, harvest=SimpleNamespace(live_lag=2))
    assert next_round(lag2, {1: {}, 2: {}}) == 3 and next_round(lag2, {1: {}, 2: {}, 3: {}}) is None


def test_a_round_is_ready_once_its_quorum_recorded_its_rollouts(tmp_path):
    run = ObjectStore(str(tmp_path))
    watch = _watch(run)
    for rank in (0, 1, 2):
        _beat(run, rank, state="training", round=2)
    assert ready_ranks(run, CONFIG, 1, watch) is None
    _quorum(run, 1, 0, 2)  # the sync that ended round 1 (its last fragment's) averaged replicas 0 and 2
    _rollouts(run, 1, 0)
    assert ready_ranks(run, CONFIG, 1, watch) is None  # replica 2 has not recorded yet
    _rollouts(run, 1, 1)  # replica 1 joined late: its rollouts are not waited for, nor read
    assert ready_ranks(run, CONFIG, 1, watch) is None
    _rollouts(run, 1, 2)
    assert ready_ranks(run, CONFIG, 1, watch) == [0, 2]
    _quorum(run, 1, 0, 1, 2, fragment=0)  # the first fragment's quorum is not the one that ended the round
    assert ready_ranks(run, CONFIG, 1, watch) == [0, 2]


def test_once_a_later_round_has_rollouts_the_missing_ones_are_not_waited_for(tmp_path):
    run = ObjectStore(str(tmp_path))
    watch = _watch(run)
    for rank in (0, 1, 2):
        _beat(run, rank, state="training", round=3)
    _quorum(run, 2, 0, 1, 2)
    _rollouts(run, 2, 1)
    assert ready_ranks(run, CONFIG, 2, watch) is None
    _rollouts(run, 3, 0)  # replica 0 recorded round 3: its round 2 (and replica 2's) will not come
    assert ready_ranks(run, CONFIG, 2, watch) == [1]
    assert ready_ranks(run, CONFIG, 1, watch) == []  # pruned, or never recorded: nothing to ask about


def test_with_no_lag_a_quorum_member_whose_rollouts_can_no_longer_come_is_not_waited_for(tmp_path):
    """With live_lag 0 no later round comes while the replicas wait for the harvest: a member of the quorum
    that will not write its rollouts (it failed, started again, or its heartbeat stopped) is not waited for.
    With a lag, the replicas go on to the next round meanwhile: the harvest waits for its rollouts."""
    run = ObjectStore(str(tmp_path))
    _quorum(run, 1, 0, 1)
    _rollouts(run, 1, 0)
    _beat(run, 1, state="failed", error="killed")
    assert ready_ranks(run, CONFIG, 1, _watch(run)) is None
    _rollouts(run, 2, 0)
    assert ready_ranks(run, CONFIG, 1, _watch(run)) == [0]

    run = ObjectStore(str(tmp_path / "lag0"))
    clock = Clock()
    watch = _watch(run, clock)
    _quorum(run, 1, 0, 1, 2)
    _rollouts(run, 1, 0)
    for rank in (0, 1, 2):
        _beat(run, rank, state="training", round=2)  # synced round 1; 1 and 2 have not recorded it yet
    assert ready_ranks(run, NO_LAG, 1, watch) is None
    _beat(run, 1, state="failed", error="killed")  # a failed replica's beat names no round
    clock.now = 59.0
    _beat(run, 0, state="waiting for the harvest of round 1", round=1)
    assert ready_ranks(run, NO_LAG, 1, watch) is None  # replica 2 may still record its rollouts
    clock.now = 60.0  # replica 2's heartbeat has not changed for the silence bound: gone
    assert ready_ranks(run, NO_LAG, 1, watch) == [0]
    # Round 2: a replica started again (its new heartbeat names no round, or one before 2: it went back to a
    # checkpoint) is gone for round 2 for good, whatever it beats next.
    other = _watch(run, Clock())
    _quorum(run, 2, 0, 1, 2)
    _rollouts(run, 2, 0)
    _beat(run, 1, state="starting")
    _beat(run, 2, state="training", round=3)
    assert ready_ranks(run, NO_LAG, 2, other) is None
    _beat(run, 1, state="training", round=3)
    _beat(run, 2, state="training", round=1)
    assert ready_ranks(run, NO_LAG, 2, other) == [0]


def test_the_spend_is_every_harvest_in_the_ledger_exactly(tmp_path):
    """Every harvest's entry counts, the two of a round harvested twice (its first report was never
    written) included; reports are not what is counted."""
    run = ObjectStore(str(tmp_path))
    for k, attempt, spent in ((1, "a", "1/3"), (1, "b", "0"), (2, "c", "1/6")):
        run.put(layout.harvest_spend(k, attempt), json.dumps({"round": k, "spent_exact": spent}).encode())
    run.put(layout.harvest_report(1), json.dumps({"round": 1, "spent_exact": "0"}).encode())
    assert sum(counted_spend(run).values()) == Fraction(1, 2)
    # The entries of harvests that ended are final: those already read are not read again.
    known = counted_spend(run)
    run.put(layout.harvest_spend(3, "d"), json.dumps({"round": 3, "spent_exact": "1/2"}).encode())
    again = counted_spend(run, {**known, next(iter(known)): Fraction(0)})
    assert len(again) == 4 and sum(again.values()) == Fraction(2, 3)


def test_reports_are_read_once(tmp_path):
    run = ObjectStore(str(tmp_path))
    for k in (1, 2):
        run.put(layout.harvest_report(k), json.dumps({"round": k, "pairs": k}).encode())
    reports = harvested_rounds(run)
    run.put(layout.harvest_report(3), json.dumps({"round": 3, "pairs": 3}).encode())
    again = harvested_rounds(run, {**reports, 1: {"round": 1, "pairs": 0}})
    assert {k: r["pairs"] for k, r in again.items()} == {1: 0, 2: 2, 3: 3}


@pytest.mark.parametrize(
    ("rounds", "lag", "fix"),
    [
        (3, 2, "Set harvest.live_lag to at most 1, or diloco.rounds to at least 4"),
        (1, 0, "Set diloco.rounds to at least 2"),
    ],
)
def test_a_lag_that_leaves_no_round_to_harvest_is_refused(tmp_path, rounds, lag, fix):
    teachers = [
        SimpleNamespace(base_url="http://127.0.0.1:9/v1", usd_per_m_input=1.0, usd_per_m_output=1.0)
    ] * 3
    with pytest.raises(ConfigError) as refused:
        live_run_config(teachers, tmp_path, "lagged", rounds, live_lag=lag)
    message = str(refused.value)
    assert f"harvest.live_lag = {lag} leaves no round to harvest in a run of {rounds} rounds" in message
    assert fix in message
    assert live_run_config(teachers, tmp_path, "lagged", lag + 2, live_lag=lag).harvest.live_lag == lag
