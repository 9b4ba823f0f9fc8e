"""Which round a live harvest takes, and what the run has spent: from the objects in the store."""

from __future__ import annotations

import json
from fractions import Fraction
from types import SimpleNamespace

from composer_serverless.harvest.live import harvested_rounds, ready_round, spent_so_far
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import ObjectStore

CONFIG = SimpleNamespace(diloco=SimpleNamespace(replicas=2, rounds=6))


def _rollouts(run, k, *ranks):
    for rank in ranks:
        run.put(layout.rollouts(k, rank), b'{"prompt": "p", "student": "s"}\n')


def test_the_newest_complete_round_not_yet_harvested(tmp_path):
    run = ObjectStore(str(tmp_path))
    assert ready_round(run, CONFIG, set()) is None
    _rollouts(run, 1, 0)
    assert ready_round(run, CONFIG, set()) is None  # replica 1 has not written round 1 yet
    _rollouts(run, 1, 1)
    assert ready_round(run, CONFIG, set()) == 1
    _rollouts(run, 2, 0, 1)
    _rollouts(run, 3, 1)
    assert ready_round(run, CONFIG, set()) == 2  # 3 is incomplete; 2 is newer than 1
    assert ready_round(run, CONFIG, {2}) is None  # the newest ready one is done: older ones are stale
    _rollouts(run, 4, 0)
    assert ready_round(run, CONFIG, {2}) == 3  # a later round exists: replica 0's round 3 will not come
    _rollouts(run, 5, 0, 1)
    assert ready_round(run, CONFIG, set()) == 4  # 5 = rounds - 1: its pairs would be replayed by no round


def test_the_spend_is_every_report_exactly(tmp_path):
    run = ObjectStore(str(tmp_path))
    for k, spent in ((1, "1/3"), (2, "1/6")):
        run.put(layout.harvest_report(k), json.dumps({"round": k, "spent_exact": spent}).encode())
    reports = harvested_rounds(run)
    assert set(reports) == {1, 2} and spent_so_far(reports) == Fraction(1, 2)
