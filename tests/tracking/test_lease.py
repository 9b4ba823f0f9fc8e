"""Two relays of one run (`status` run while the launcher watches): only the lease holder logs; once it gives
the lease up, the other goes on from the holder's cursor, so every step is logged once."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from composer_serverless.config import RunConfig, validate_config
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import Body, ObjectStore
from composer_serverless.tracking import relay
from composer_serverless.tracking.relay import Relay
from tests.tracking.recording import Recorded


def _write_round(run: ObjectStore, k: int, replicas: int = 2, h: int = 2) -> None:
    for rank in range(replicas):
        steps = [{"loss": float(10 * k + i), "time_s": {"sync": 0.0}} for i in range(h)]
        row = {
            "rank": rank,
            "round": k,
            "participants": list(range(replicas)),
            "step_rows": steps,
            **{"bytes_up": 1, "bytes_down": 1, "time_s": {"sync": 0.0}, "blocked_s": 0.0, "round_s": 1.0},
        }
        run.put(layout.metrics(rank, k), json.dumps(row).encode())


def test_only_the_lease_holder_relays_and_the_next_goes_on_from_its_cursor(tmp_path) -> None:
    config = validate_config(
        {
            "run_id": "leased",
            "store": str(tmp_path / "store"),
            "model": {"tiny": {}},
            "diloco": {"replicas": 2, "sync_every": 2, "rounds": 3},
            "tracking": {"report_to": ["tensorboard"], "dir": str(tmp_path / "relay")},
        }
    )
    run = ObjectStore(str(tmp_path / "store")).child("leased")
    _write_round(run, 1)
    watching, status = Relay(run, config), Relay(run, config)
    assert watching.catch_up(ended=False) == 2  # round 1's two steps
    _write_round(run, 2)
    assert status.catch_up(ended=False) == 0, "the watching relay holds the lease"
    watching.close()  # the launcher detached
    _write_round(run, 3)
    assert status.catch_up(ended=True) == 4  # rounds 2 and 3, nothing of round 1 again
    status.close()
    assert relay.cursors(run, ["tensorboard"]) == {"tensorboard": 3}
    events = EventAccumulator(str(run.local_dir(layout.TRACKING_TENSORBOARD)), size_guidance={"scalars": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (1, 10.0),
        (2, 11.0),
        (3, 20.0),
        (4, 21.0),
        (5, 30.0),
        (6, 31.0),
    ]


# --- two relays at once: each step reaches each tracker once, whatever the interleaving --------------------

NAMES = ["tensorboard", "wandb"]


@pytest.fixture(params=["directory", "s3"])
def root(request: pytest.FixtureRequest, tmp_path) -> str:
    return str(tmp_path / "store") if request.param == "directory" else request.getfixturevalue("s3_url")


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Recorded:
    """Every relay's tracker runs log into one record."""
    record = Recorded()
    monkeypatch.setattr(relay, "open_tracker", record.open)
    return record


def _two_trackers(root: str, tmp_path) -> RunConfig:
    return validate_config(
        {
            "run_id": "leased",
            "store": root,
            "model": {"tiny": {}},
            "diloco": {"replicas": 2, "sync_every": 2, "rounds": 3},
            "tracking": {"report_to": NAMES, "dir": str(tmp_path / "relay")},
        }
    )


class _MeetingStore(ObjectStore):
    """Holds each thread's first write under ``tracking/`` until every thread has reached its own: the relays
    have all looked at the lease, and found it free, before any of them takes it."""

    meeting: threading.Barrier
    met: set[str]

    def put(self, key: str, data: Body) -> None:
        self._meet(key)
        super().put(key, data)

    def create(self, key: str, data: Body) -> bool:
        self._meet(key)
        return super().create(key, data)

    def _meet(self, key: str) -> None:
        name = threading.current_thread().name
        if key.startswith(f"{layout.TRACKING}/") and name not in self.met:
            self.met.add(name)
            self.meeting.wait(60)


def _start(name: str, fn: Callable[[], int], results: dict[str, object]) -> threading.Thread:
    def target() -> None:
        try:
            results[name] = fn()
        except BaseException as e:  # the test reads it: a thread's failure is no silent pass
            results[name] = e

    thread = threading.Thread(target=target, name=name)
    thread.start()
    return thread


def test_two_relays_that_find_the_lease_free_at_once_log_each_step_once(root, tmp_path, recorded) -> None:
    run = _MeetingStore(root).child("leased")
    run.meeting, run.met = threading.Barrier(2), set()
    for k in (1, 2, 3):
        _write_round(run, k)
    config = _two_trackers(root, tmp_path)
    results: dict[str, object] = {}
    threads = [
        _start(name, functools.partial(Relay(run, config).catch_up, ended=True), results)
        for name in ("A", "B")
    ]
    for thread in threads:
        thread.join(120)
    assert recorded.miscounted(NAMES, range(1, 7)) == {}
    assert sorted(results.values()) == [0, 6], results  # one relay logged all six steps, the other none
    assert dict(recorded.configs) == dict.fromkeys(NAMES, 1)


def test_a_relay_that_lost_its_lease_stops_at_once_and_each_step_is_logged_once(
    root, tmp_path, recorded, monkeypatch
) -> None:
    # Every lease has lapsed by the time another relay looks at it: the holder was held still longer than a
    # lease lasts (a stopped process, a laptop asleep), and the other relay rightly takes over.
    lease_s = relay.LEASE_S
    monkeypatch.setattr(relay, "LEASE_S", -1.0)
    run = ObjectStore(root).child("leased")
    for k in (1, 2, 3):
        _write_round(run, k)
    config = _two_trackers(root, tmp_path)
    first, second = Relay(run, config), Relay(run, config)
    results: dict[str, object] = {}
    recorded.hold("A", 3)  # round 2's first step, as the first relay logs it
    thread = _start("A", functools.partial(first.catch_up, ended=True), results)
    assert recorded.held.wait(60), results
    results["B"] = second.catch_up(ended=True)
    recorded.resume.set()
    thread.join(120)
    assert recorded.miscounted(NAMES, range(1, 7)) == {}
    # The first relay had claimed round 2 for both trackers before it was held: it finished the round and
    # then stopped; the second went on from there, with round 3.
    assert results == {"A": 4, "B": 2}
    first.close()
    second.close()
    monkeypatch.setattr(relay, "LEASE_S", lease_s)
    third = Relay(run, config)
    assert third.catch_up(ended=True) == 0, "the cursors stayed at round 3"
    third.close()
    assert relay.cursors(run, NAMES) == dict.fromkeys(NAMES, 3)
    assert recorded.miscounted(NAMES, range(1, 7)) == {}


def test_a_relay_whose_clock_is_an_hour_ahead_leaves_a_live_lease(
    root, tmp_path, recorded, monkeypatch
) -> None:
    run = ObjectStore(root).child("leased")
    config = _two_trackers(root, tmp_path)
    _write_round(run, 1)
    watching, status = Relay(run, config), Relay(run, config)
    assert watching.catch_up(ended=False) == 2
    _write_round(run, 2)
    ahead = types.SimpleNamespace(time=lambda: time.time() + 3600.0)
    with monkeypatch.context() as skewed:
        skewed.setattr(relay, "time", ahead, raising=False)
        assert status.catch_up(ended=False) == 0, "the lease was renewed a moment ago, by the store's clock"
    assert watching.catch_up(ended=False) == 2
    watching.close()
    status.close()
    assert recorded.miscounted(NAMES, range(1, 5)) == {}


def test_the_lease_of_a_relay_that_died_is_taken_once_the_store_says_it_lapsed(tmp_path, recorded) -> None:
    root = str(tmp_path / "store")
    run = ObjectStore(root).child("leased")
    config = _two_trackers(root, tmp_path)
    _write_round(run, 1)
    assert Relay(run, config).catch_up(ended=False) == 2  # and is never closed: its process was killed
    _write_round(run, 2)
    status = Relay(run, config)
    assert status.catch_up(ended=False) == 0, "the lease is live"
    assert relay.holder(run) is not None
    # The dead relay's last renewal, by the store's clock, a lease and a second ago.
    lease = Path(run.path(layout.tracking_lease(1)))
    then = lease.stat().st_mtime - relay.LEASE_S - 1
    os.utime(lease, (then, then))
    assert status.catch_up(ended=False) == 2
    status.close()
    assert relay.holder(run) is None, "given up"
    assert recorded.miscounted(NAMES, range(1, 5)) == {}


def test_a_round_whose_logging_failed_stays_claimed_and_is_never_logged_twice(tmp_path, recorded) -> None:
    """The rule when a relay fails mid-round: the round is its own, so no relay logs it to that tracker again
    (nothing twice); the rounds after it are the next relay's."""
    root = str(tmp_path / "store")
    run = ObjectStore(root).child("leased")
    config = _two_trackers(root, tmp_path)
    for k in (1, 2, 3):
        _write_round(run, k)
    failing = Relay(run, config)
    recorded.fail(4)  # round 2's second step, in the first tracker that logs it
    with pytest.raises(RuntimeError, match="tensorboard failed at step 4"):
        failing.catch_up(ended=True)
    failing.close()
    assert Relay(run, config).catch_up(ended=True) == 2  # round 3
    assert recorded.miscounted(NAMES, range(1, 7)) == {"tensorboard": {4: 0}, "wandb": {3: 0, 4: 0}}


_HOLD_THE_LEASE = """
import sys, time
from composer_serverless.config import RunConfig
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.tracking.relay import Relay
config = RunConfig.model_validate_json(sys.stdin.read())
assert Relay(ObjectStore(config.store).child("leased"), config).catch_up(ended=False) == 2
print("holding", flush=True)
time.sleep(600)
"""


def test_a_relay_takes_the_lease_at_once_from_a_dead_relay_on_this_machine(tmp_path) -> None:
    """A launcher killed while it held the lease, then resumed on the same machine: the new relay sees that the
    holder's process is gone and relays at once, instead of leaving the trackers a lease behind; while the
    holder's process lives, its lease is left alone."""
    root = str(tmp_path / "store")
    run = ObjectStore(root).child("leased")
    config = validate_config(
        {
            "run_id": "leased",
            "store": root,
            "model": {"tiny": {}},
            "diloco": {"replicas": 2, "sync_every": 2, "rounds": 3},
            "tracking": {"report_to": ["tensorboard"], "dir": str(tmp_path / "relay")},
        }
    )
    _write_round(run, 1)
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_THE_LEASE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        holder.stdin.write(config.model_dump_json())
        holder.stdin.close()
        assert holder.stdout.readline().strip() == "holding"
        _write_round(run, 2)
        resumed = Relay(run, config)
        assert resumed.catch_up(ended=False) == 0, "the holder's process lives: its lease is live"
    finally:
        holder.kill()
        holder.wait()
    assert resumed.catch_up(ended=False) == 2  # round 2, at once: no waiting out LEASE_S
    resumed.close()
    assert relay.cursors(run, ["tensorboard"]) == {"tensorboard": 2}


def test_a_decoupled_versions_steps_are_its_merged_contributions_even_from_rows_relayed_before(
    tmp_path,
) -> None:
    """Learner 0 sent its second contribution before it saw version 1, so its row of version 1 carries it; a
    later relay (``status``, starting from the cursor past version 1) reads that row back for version 2."""
    config = validate_config(
        {
            "run_id": "versions",
            "store": str(tmp_path / "store"),
            "model": {"tiny": {}},
            "diloco": {"replicas": 2, "sync_every": 2, "rounds": 2, "mode": "decoupled"},
            "tracking": {"report_to": ["tensorboard"], "dir": str(tmp_path / "relay")},
        }
    )
    run = ObjectStore(str(tmp_path / "store")).child("versions")

    def adopted(rank: int, version: int, sent: dict[int, list[float]]) -> None:
        steps = [[{"loss": loss, "time_s": {"sync": 0.0}} for loss in losses] for losses in sent.values()]
        row = {"rank": rank, "round": version, "contributions": list(sent)}
        if steps:
            row.update(step_rows=steps[-1], bytes_up=1, bytes_down=0, time_s={"sync": 0.0}, blocked_s=0.0)
            row["round_s"] = 1.0
        if len(steps) > 1:
            row["earlier_step_rows"] = steps[:-1]
        run.put(layout.metrics(rank, version), json.dumps(row).encode())

    def committed(version: int, merged: list[list[int]]) -> None:
        run.put(layout.version(version), json.dumps({"version": version, "merged": merged}).encode())

    adopted(0, 1, {0: [1.0, 3.0], 1: [5.0, 7.0]})
    adopted(1, 1, {0: [2.0, 4.0]})
    committed(1, [[0, 0], [1, 0]])
    watching = Relay(run, config)
    assert watching.catch_up(ended=False) == 2  # version 1; version 2 is not committed
    watching.close()
    committed(2, [[0, 1], [1, 1]])
    adopted(0, 2, {})  # learner 0 adopted version 2 before it sent again
    status = Relay(run, config)
    assert status.catch_up(ended=False) == 0, "learner 1's second contribution has no row yet"
    adopted(1, 2, {1: [6.0, 8.0]})
    assert status.catch_up(ended=False) == 2
    status.close()
    events = EventAccumulator(str(run.local_dir(layout.TRACKING_TENSORBOARD)), size_guidance={"scalars": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (1, 1.5),
        (2, 3.5),
        (3, 5.5),
        (4, 7.5),
    ]
