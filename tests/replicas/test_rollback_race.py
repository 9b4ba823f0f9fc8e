"""A rollback that lands while a replica decides whether it is in step with the run: the replica reads the
rollback epoch (and whether a rollback of it is claimed) after everything else it decides on, so it never
trains a round from the state the rollback replaced."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from rich.console import Console

from composer_serverless.accelerator.simulated import simulated
from composer_serverless.config import RunConfig, validate_config
from composer_serverless.launch.launcher import create_run
from composer_serverless.rendezvous import latest, layout, recovery
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import read_heartbeats
from composer_serverless.replicas import catchup
from composer_serverless.replicas.trainer import run_replica


@pytest.mark.parametrize("rollback", ["made", "claimed"])
def test_a_rollback_landing_while_a_replica_aligns_is_never_trained_past(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch, caplog, rollback: str
) -> None:
    """A replica restores round 3 (checkpoints 2 and 3 kept) and, as it looks whether the run is ahead of it,
    another replica rolls the run back to checkpoint 2 (round 3's state found damaged): ``made`` whole, or
    ``claimed`` and half made (its claimant stalled before recording it; the replica takes it over). Either way
    it restores round 2 before training: it never trains round 4 from round 3's state, publishing it as
    the run's. Before, it read the epoch before the rollback and trained round 4 on."""
    config = validate_config(
        {
            "run_id": "race",
            "store": str(tmp_path),
            "model": {"path": str(tiny_model_dir)},
            "data": {"seq_len": 16, "batch_size": 2},
            "diloco": {"replicas": 1, "sync_every": 1, "rounds": 3, "checkpoint_every": 2},
            "eval": {"sequences": 2, "every_rounds": 10},
        }
    )
    run, _ = create_run(config, "test", Console(quiet=True))
    with simulated():
        run_replica(ObjectStore(run.url), 0)
    assert latest.kept_checkpoints(run) == [3, 2]
    longer = RunConfig.model_validate_json(run.get(layout.RUN_CONFIG))
    longer = longer.model_copy(update={"diloco": longer.diloco.model_copy(update={"rounds": 5})})
    run.put(layout.RUN_CONFIG, longer.model_dump_json().encode())

    real_behind = catchup.behind
    landed: list[int] = []

    def rolled_back_meanwhile(store: ObjectStore, upcoming: int) -> int:
        if not landed:  # the first look, right after the replica restored round 3
            landed.append(upcoming)
            run.delete(f"{layout.global_state(3)}/{layout.SNAPSHOT_MANIFEST}")
            if rollback == "made":
                assert recovery.roll_back(ObjectStore(run.url), 0, 4, rank=1) is not None
            else:
                assert run.create(layout.rollback_claim(0, 0), b'{"rank": 1}')
                latest.roll_back(run)  # its changes, all but the record that moves the epoch
        return real_behind(store, upcoming)

    monkeypatch.setattr(catchup, "behind", rolled_back_meanwhile)
    monkeypatch.setattr(recovery, "takeover_after_s", lambda retry: 0.05)  # the stalled claimant's
    caplog.set_level(logging.WARNING)
    with simulated():
        run_replica(ObjectStore(run.url), 0)
    assert landed == [4]
    assert "the run was rolled back (epoch 1): continuing from round 2 (was at round 3)" in caplog.text
    (back,) = recovery.rollbacks(run)
    assert back.to == 2 and back.by == (1 if rollback == "made" else 0)
    assert latest.latest_round(run) == 5 and read_heartbeats(run)[0]["state"] == "done"
