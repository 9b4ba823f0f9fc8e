"""A replica that finds the run past its round and cannot catch up (nobody publishes the round it waits for)
stops after ``diloco.max_failed_syncs`` instead of waiting and syncing stale rounds for ever: a stale sync
counts as failed unless the catch-up after it loads a published state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from composer_serverless.config import validate_config
from composer_serverless.launch.launcher import create_run
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import read_heartbeats
from composer_serverless.replicas import catchup
from composer_serverless.replicas.trainer import SyncError, run_replica

MAX_FAILED_SYNCS = 2


def test_a_replica_that_cannot_catch_up_stops_after_max_failed_syncs(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch
) -> None:
    """The run is at round 5 (its quorum is fixed, with replica 1 only) and has no published state; replica
    0 starts fresh. Each wait for round 5 times out (replica 1 may hold it, by its heartbeat), so replica 0
    trains round 1 on, and its sync of round 1 is stale. It waits three times (once before round 1, once
    after each stale sync) and stops with a SyncError after the second stale sync; before, every stale sync
    reset the count and it looped."""
    config = validate_config(
        {
            "run_id": "stale",
            "store": str(tmp_path),
            "model": {"path": str(tiny_model_dir)},
            "data": {"seq_len": 16, "batch_size": 2},
            "diloco": {
                "replicas": 2,
                "min_replicas": 1,
                "sync_every": 1,
                "rounds": 6,
                "quorum_grace_min_s": 0.05,
                "quorum_grace_max_s": 0.05,
                "max_failed_syncs": MAX_FAILED_SYNCS,
            },
            "eval": {"sequences": 2},
        }
    )
    run, _ = create_run(config, "test", Console(quiet=True))
    run.put(layout.quorum(5, 0), json.dumps({"participants": [1]}).encode())
    waits: list[int] = []

    def timed_out(store, round_index, rank, replicas, epoch, timeout_s, on_wait) -> catchup.Waited:
        waits.append(round_index)
        assert len(waits) <= 10, "the replica waits and syncs stale rounds without end"
        return catchup.Waited(holders=(1,))

    monkeypatch.setattr(catchup, "wait_for_round", timed_out)
    with pytest.raises(SyncError, match=r"2 syncs failed in a row, the last stale .*could not catch up"):
        run_replica(ObjectStore(run.url), 0)
    assert waits == [5, 5, 5]
    assert read_heartbeats(run)[0]["state"] == "failed"
