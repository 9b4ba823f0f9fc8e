"""Every replica of a run lost at once: the launcher starts them again and they roll the run back to its newest
intact checkpoint by themselves (``rendezvous/recovery.py``), redo the rounds after it and finish, on a local
directory and on a real S3 server (moto). Without the rollback every restarted replica would wait, paid for,
for a round nobody holds."""

from __future__ import annotations

import io
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from rich.console import Console

from composer_serverless.config import validate_config
from composer_serverless.executors.base import LaunchRecord
from composer_serverless.executors.local import UNSCHEDULED_ENV
from composer_serverless.launch.launcher import launch
from composer_serverless.rendezvous import layout, recovery
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import read_heartbeats

pytestmark = pytest.mark.slow

ROUNDS, KILL_IN, REPLICAS = 8, 4, 2
SYNC_EVERY = 5
WAIT_S = 300


def _kill_all_in(
    run: ObjectStore, round_index: int, killed: list[int], before: Callable[[], None] = lambda: None
) -> None:
    """SIGKILL every replica process together once each has been seen training ``round_index`` or a later
    round (``before`` just before).

    Each is stopped (SIGSTOP) as soon as it is seen there. A round of these tiny steps lasts tens of
    milliseconds, less than a poll on a busy machine can promise, and waiting to see every replica in the
    round at once missed it (the full suite on a 2-core machine, twice, with 2 and then 5 steps a round).
    A stopped replica either holds the others in its round (``min_replicas`` = replicas: they cannot
    finish its sync) or lets them go on, to be seen and stopped in a later one; so the replicas are always
    found, before the run's last round."""
    deadline = time.monotonic() + WAIT_S
    stopped: dict[int, int] = {}  # rank -> pid
    while time.monotonic() < deadline:
        beats = read_heartbeats(run) if run.exists(layout.MEMBERS) else {}
        seen = [
            rank
            for rank, b in beats.items()
            if rank not in stopped and b.get("state") == "training" and b.get("round", 0) >= round_index
        ]
        if seen:
            pids = {
                h.rank: int(h.backend_id)
                for h in LaunchRecord.from_json(run.get(layout.LAUNCH_RECORD)).current()
            }
            for rank in seen:
                os.kill(pids[rank], signal.SIGSTOP)
                stopped[rank] = pids[rank]
        if len(stopped) == REPLICAS:
            before()
            for pid in stopped.values():
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            return
        time.sleep(0.02)


@pytest.mark.parametrize("where", ["directory", "s3"])
def test_every_replica_killed_at_once_rolls_back_by_itself_and_finishes(
    tmp_path: Path, tiny_model_dir: Path, where: str, request: pytest.FixtureRequest
) -> None:
    """No checkpoint yet (``checkpoint_every`` 10) when both replicas are killed in round 4: the restarted
    replicas find nobody holding round 4, roll the run back to its start, and the launcher's own restarts
    finish all rounds; the report names the rollback and the redone rounds."""
    store = str(tmp_path / "runs") if where == "directory" else request.getfixturevalue("s3_url")
    config = validate_config(
        {
            "run_id": "correlated",
            "store": store,
            "model": {"path": str(tiny_model_dir)},
            "data": {"seq_len": 16, "batch_size": 2},
            "train": {"lr": 1e-2},
            # Both replicas in every round (min_replicas 2): what the run does does not depend on timing.
            "diloco": {
                "replicas": REPLICAS,
                "min_replicas": REPLICAS,
                "sync_every": SYNC_EVERY,
                "rounds": ROUNDS,
            },
            "eval": {"sequences": 2},
            "executor": {"threads_per_replica": 1, "max_restarts": 1},
        }
    )
    assert config.diloco.checkpoint_every > KILL_IN
    run = ObjectStore(store).child("correlated")
    killed: list[int] = []
    killer = threading.Thread(target=_kill_all_in, args=(run, KILL_IN, killed), daemon=True)
    killer.start()
    output = io.StringIO()
    summary = launch(config, "correlated.toml", Console(file=output, width=200))
    killer.join(timeout=5)
    assert len(killed) == REPLICAS and not any(psutil.pid_exists(p) and _running(p) for p in killed)
    assert summary is not None and summary["rounds_committed"] == ROUNDS, output.getvalue()
    assert summary["replicas_bit_identical"]
    (back,) = recovery.rollbacks(run)
    # Killed while training round 4 (its quorum not yet fixed: they waited for round 3), or in its sync; or a
    # round later, where a replica's heartbeat was read a round late (never before the last checkpoint-free one)
    assert back.to == 0 and KILL_IN - 1 <= back.waited_for < ROUNDS
    assert summary["rollbacks"] == [{"waited_for": back.waited_for, "to": 0, "redone": back.redone}]
    assert summary["rounds_redone"] == back.redone == back.waited_for - 1
    assert "rolled the run back to round 0" in output.getvalue()
    record = LaunchRecord.from_json(run.get(layout.LAUNCH_RECORD))
    assert sorted(h.attempt for h in record.handles) == [1, 1, 2, 2]  # each started again once
    assert not any(_running(int(h.backend_id)) for h in record.handles)  # nothing left running


def test_every_replica_killed_and_one_restart_unscheduled_rolls_back_without_it(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both replicas are killed in round 4 and replica 1's restart gets no hardware (the local executor's
    benchmark seam): the launcher gives it up, and replica 0, which finds the run rounds ahead, does not wait
    for replica 1 (whose last heartbeat still says "training") to publish the round: it rolls the run back at
    once and finishes alone. Before, it waited diloco.sync_timeout_s (600 s) for replica 1, trained on, synced a
    stale round and waited again, without end."""
    requests = tmp_path / "unscheduled"
    requests.mkdir()
    monkeypatch.setenv(UNSCHEDULED_ENV, str(requests))
    config = validate_config(
        {
            "run_id": "given-up",
            "store": str(tmp_path / "runs"),
            "model": {"path": str(tiny_model_dir)},
            "data": {"seq_len": 16, "batch_size": 2},
            "train": {"lr": 1e-2},
            "diloco": {"replicas": REPLICAS, "min_replicas": 1, "sync_every": SYNC_EVERY, "rounds": ROUNDS},
            "eval": {"sequences": 2},
            "executor": {"threads_per_replica": 1, "max_restarts": 1},
        }
    )
    run = ObjectStore(str(tmp_path / "runs")).child("given-up")
    killed: list[int] = []
    killer = threading.Thread(
        target=_kill_all_in,
        args=(run, KILL_IN, killed, lambda: (requests / "1").touch()),
        daemon=True,
    )
    killer.start()
    output = io.StringIO()
    summary = launch(config, "given-up.toml", Console(file=output, width=200))
    killer.join(timeout=5)
    assert len(killed) == REPLICAS and not (requests / "1").exists()
    assert summary is not None and summary["rounds_committed"] == ROUNDS, output.getvalue()
    assert "replica 1 got no hardware" in output.getvalue()
    (back,) = recovery.rollbacks(run)
    assert back.to == 0 and back.by == 0
    assert recovery.given_up(run) == {1}
    beats = read_heartbeats(run)
    assert (
        beats[0]["state"] == "done" and beats[1]["state"] == "training"
    )  # killed in round 4, never restarted
    record = LaunchRecord.from_json(run.get(layout.LAUNCH_RECORD))
    assert [(h.rank, h.attempt, h.backend_id) for h in record.handles if not h.backend_id.isdigit()] == [
        (1, 2, "unscheduled-1-2")
    ]


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
