"""The launcher's live harvester on its own (no replicas: the test writes the rollouts and quorums they would):
it harvests every round of the schedule in order, reads only the rollouts of each round's quorum, beats while
it runs and says when it stopped; a round the replicas went on without is not asked about, and a harvest in
progress when they do is cancelled with its requests in flight counted at their worst case."""

from __future__ import annotations

import io
import json
import threading
import time
from fractions import Fraction

import pytest
from rich.console import Console

from composer_serverless.harvest import live
from composer_serverless.harvest.costs import worst_case
from composer_serverless.harvest.harvester import request_body
from composer_serverless.objectives.harvest_schedule import TIMED_OUT, Taken
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.polling import poll_until
from composer_serverless.rendezvous.store import ObjectStore
from tests.harvest.conftest import CANARY, live_run_config
from tests.harvest.fake_teacher import Behaviour

WAIT_S = 60.0  # what the test waits at most for the harvester; reaching it fails the test
RIGHT = {"add 2 3=": "5", "add 4 4=": "8", "add 1 6=": "7", "add 1 1=": "2"}


@pytest.fixture
def quick(monkeypatch):
    monkeypatch.setenv("TEACHER_KEY", CANARY)
    monkeypatch.setattr(live, "POLL_S", 0.02)
    monkeypatch.setattr(live, "BEAT_S", 0.02)


def _scripted(fakes, gate=None):
    """careful and steady give the right answer, sloppy a wrong one; with ``gate``, only once it is set."""
    for index, fake in enumerate(fakes):
        slip = "0" if index == 2 else ""

        def script(prompt, attempt, slip=slip):
            if gate is not None:
                gate.wait(WAIT_S)
            return Behaviour(answer=f"The answer is {RIGHT[prompt]}{slip}.")

        fake.script = script


def _round(run, k, quorum, students):
    """What the replicas leave of round k: each one's rollouts ({rank: {prompt: answer}}) and the quorum of
    the sync that ended it."""
    for rank, answers in students.items():
        rows = [
            {"id": f"r{rank}-k{k}-{n}", "prompt": p, "student": a, "reward": 0.0}
            for n, (p, a) in enumerate(answers.items())
        ]
        run.put(layout.rollouts(k, rank), "".join(json.dumps(r) + "\n" for r in rows).encode())
    run.put(layout.quorum(k, 0), json.dumps({"participants": quorum}).encode())


def _until(check):
    found = poll_until(check, time.monotonic() + WAIT_S)
    assert found is not None, "the harvester did not get there"
    return found


def _report(run, k):
    return _until(
        lambda: (
            json.loads(run.get(layout.harvest_report(k))) if run.exists(layout.harvest_report(k)) else None
        )
    )


def _harvest_round_1(run: ObjectStore, config) -> dict:
    """Run a harvester until round 1's report is written; stop it; the report."""
    harvester = live.LiveHarvester(run, config, Console(file=io.StringIO(), width=200))
    harvester.start()
    try:
        return _report(run, 1)
    finally:
        harvester.stop()


def _beat(run):
    return json.loads(run.get(layout.HARVESTER))


def _beating(run, state):
    return _until(lambda: run.exists(layout.HARVESTER) and _beat(run)["state"].startswith(state) or None)


def test_every_round_in_order_from_its_quorums_rollouts(teachers, tmp_path, quick):
    fakes = teachers(3, key=CANARY, usd_per_m_input=2.0, usd_per_m_output=8.0)
    _scripted(fakes)
    config = live_run_config(fakes, tmp_path, "harvested", rounds=4)  # live_lag 1: rounds 1 and 2
    run = ObjectStore(str(tmp_path / "harvested"))
    _round(run, 1, [0, 1], {0: {"add 2 3=": "6"}, 1: {"add 4 4=": "8", "add 1 6=": "1"}})
    out = io.StringIO()
    harvester = live.LiveHarvester(run, config, Console(file=out, width=200))
    harvester.start()
    try:
        first = _report(run, 1)
        assert (first["ranks"], first["prompts"], first["pairs"], first["student_agreed"]) == (
            [0, 1],
            3,
            2,
            1,
        )
        pairs = [json.loads(line) for line in run.get(layout.harvested_pairs(1)).decode().splitlines()]
        assert {(p["prompt"], p["chosen"], p["rejected"]) for p in pairs} == {
            ("add 2 3=", "5", "6"),
            ("add 1 6=", "7", "1"),
        }
        assert all(p["provenance"]["agreement"]["voters"] == ["careful", "steady"] for p in pairs)
        assert Fraction(first["spent_exact"]) == sum(f.billed for f in fakes)
        assert _beating(run, "waiting for the rollouts of round 2")

        # Round 2's quorum was replica 1 alone; replica 0 joined late: its rollouts are not asked about.
        _round(run, 2, [1], {0: {"add 1 1=": "0"}, 1: {"add 4 4=": "2"}})
        second = _report(run, 2)
        assert (second["ranks"], second["prompts"], second["pairs"]) == ([1], 1, 1)
        assert all(f.attempts["add 1 1="] == 0 for f in fakes)
        assert _beating(run, "done")
    finally:
        harvester.stop("the test is over")
    assert {k: v for k, v in _beat(run).items() if k != "time"} == {
        "state": "stopped",
        "reason": "the test is over",
    }
    assert set(live.harvested_rounds(run)) == {1, 2}  # rounds 3 and 4 never: replayed by no round
    lines = [line for line in out.getvalue().splitlines() if "harvest of round" in line]
    assert [line.split(":")[0].strip() for line in lines] == ["harvest of round 1", "harvest of round 2"]


def test_a_round_the_replicas_went_on_without_is_not_asked_and_a_harvest_under_way_stops(
    teachers, tmp_path, quick
):
    """Round 1's harvest is under way (its six requests held by the teachers) when the replicas decide, at
    the end of round 2, to take nothing: it is cancelled, counted at its worst case. Round 2's pairs are
    given up on (decided at the end of round 3) before its rollouts are all there: it is never asked about.
    Round 3's is harvested as usual."""
    fakes = teachers(3, key=CANARY, usd_per_m_input=2.0, usd_per_m_output=8.0)
    gate = threading.Event()
    _scripted(fakes, gate)
    config = live_run_config(fakes, tmp_path, "late", rounds=5)  # live_lag 1: rounds 1, 2 and 3
    run = ObjectStore(str(tmp_path / "late"))
    _round(run, 1, [0, 1], {0: {"add 2 3=": "6"}, 1: {"add 4 4=": "3"}})
    harvester = live.LiveHarvester(run, config, Console(file=io.StringIO(), width=200))
    harvester.start()
    try:
        assert _until(lambda: sum(f.in_flight for f in fakes) == 6 or None)
        assert _beating(run, "harvesting round 1")
        held = [
            worst_case(request_body(config.harvest, teacher, prompt), teacher)
            for prompt in ("add 2 3=", "add 4 4=")
            for teacher in config.harvest.teachers
        ]
        # Each request was in the run's ledger before it went: a launcher killed now leaves them counted.
        assert sum(live.counted_spend(run).values()) == sum(held)
        gave_up = Taken(2, 1, False, TIMED_OUT, "no report within harvest.live_wait_s = 0s", 0)
        run.put(layout.harvest_taken(2), gave_up.to_json())
        first = _report(run, 1)
        gate.set()
        assert (
            first["cancelled"]
            == "too late: the end of round 2 took nothing (no report within harvest.live_wait_s = 0s)"
        )
        assert first["pairs_file"] is None and Fraction(first["spent_exact"]) == sum(held)

        # Round 2: replica 1's rollouts never came, and the end of round 3 took nothing.
        _round(run, 2, [0, 1], {0: {"add 1 6=": "2"}})
        assert _beating(run, "waiting for the rollouts of round 2")
        run.put(layout.harvest_taken(3), Taken(3, 2, False, TIMED_OUT, "waited 0s", 1).to_json())
        assert _report(run, 2)["skipped"] == "too late: the end of round 3 took nothing (waited 0s)"
        _round(run, 3, [0, 1], {0: {"add 2 3=": "2"}, 1: {"add 4 4=": "3"}})
        third = _report(run, 3)
    finally:
        gate.set()
        harvester.stop()
    assert third["pairs"] == 2 and Fraction(third["spent_exact"]) > 0
    assert all(f.attempts["add 1 6="] == 0 for f in fakes)  # round 2's prompt: never asked
    # The cap stays hard: nothing billed was left uncounted.
    assert sum(f.billed for f in fakes) <= sum(live.counted_spend(run).values())


def test_a_harvest_whose_report_was_lost_is_still_counted(teachers, tmp_path, quick):
    """Round 1's report cannot be written the first time: the round is harvested again, from the cache for
    $0, and the cap still counts what the first harvest spent (the ledger holds it, not the report)."""
    fakes = teachers(3, key=CANARY, usd_per_m_input=2.0, usd_per_m_output=8.0)
    _scripted(fakes)
    config = live_run_config(fakes, tmp_path, "lost", rounds=3)  # live_lag 1: round 1 only
    refused: list[str] = []

    class FlakyStore(ObjectStore):
        def put(self, key, data):
            if self.url.endswith("/lost") and key == layout.harvest_report(1) and not refused:
                refused.append(key)
                raise OSError("the store refused the write")
            return super().put(key, data)

    run = FlakyStore(str(tmp_path / "lost"))
    _round(run, 1, [0, 1], {0: {"add 2 3=": "6"}, 1: {"add 4 4=": "3"}})
    report = _harvest_round_1(run, config)
    billed = sum(f.billed for f in fakes)
    assert refused and billed > 0 and len(fakes[0].seen) == 2  # asked once: the second time, the cache
    assert Fraction(report["spent_exact"]) == 0 and report["spent_before_usd"] == float(billed)
    assert sum(live.counted_spend(run).values()) == billed


def test_a_harvester_that_does_not_stop_in_time_is_left_behind_saying_so(
    teachers, tmp_path, quick, monkeypatch, caplog
):
    """Its last heartbeat write hangs (a store that stopped answering) until stop has given up on it."""
    fakes = teachers(3, key=CANARY)
    config = live_run_config(fakes, tmp_path, "stuck", rounds=3)
    released = threading.Event()

    class HangingStore(ObjectStore):
        def put(self, key, data):
            if key == layout.HARVESTER and b'"stopped"' in data:
                released.wait(WAIT_S)
            return super().put(key, data)

    run = HangingStore(str(tmp_path / "stuck"))
    monkeypatch.setattr(live, "STOP_WAIT_S", 0.01)
    out = io.StringIO()
    harvester = live.LiveHarvester(run, config, Console(file=out, width=400))
    harvester.start()
    assert _beating(run, "waiting for the rollouts of round 1")
    harvester.stop()
    released.set()
    assert "the harvester did not stop within 0.01s" in caplog.text
    assert "is left behind" in out.getvalue()


def test_with_no_lag_a_member_that_failed_before_recording_is_not_waited_for(teachers, tmp_path, quick):
    """live_lag 0: every replica waits for round 1's harvest at round 1's end, so no later round brings
    rollouts; replica 1 failed between the sync and recording its own. The harvest asks about replica 0's."""
    fakes = teachers(3, key=CANARY, usd_per_m_input=2.0, usd_per_m_output=8.0)
    _scripted(fakes)
    config = live_run_config(fakes, tmp_path, "lagless", rounds=2, live_lag=0)
    run = ObjectStore(str(tmp_path / "lagless"))
    _round(run, 1, [0, 1], {0: {"add 2 3=": "6"}})
    run.put(layout.heartbeat(0), json.dumps({"rank": 0, "state": "waiting", "round": 1}).encode())
    run.put(layout.heartbeat(1), json.dumps({"rank": 1, "state": "failed", "error": "killed"}).encode())
    report = _harvest_round_1(run, config)
    assert (report["ranks"], report["prompts"], report["pairs"]) == ([0], 1, 1)
