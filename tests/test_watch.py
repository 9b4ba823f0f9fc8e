"""The launcher's progress display, driven by heartbeats in the store and a scripted supervisor."""

from __future__ import annotations

import io
import json
import uuid
from types import SimpleNamespace

import pytest
from rich.console import Console

from composer_serverless.config import RunConfig, validate_config
from composer_serverless.executors.base import ReplicaStatus
from composer_serverless.launch import watch
from composer_serverless.launch.supervisor import Poll
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import ObjectStore
from tests.conftest import TINY


class ScriptedSupervisor:
    """Runs the heartbeats it is given, one list per poll; the run is finished after the last."""

    def __init__(self, run: ObjectStore, script: list[list[dict]], ranks: int = 1) -> None:
        self.run = run
        self.script = script
        self.handles = [SimpleNamespace(rank=rank) for rank in range(ranks)]
        self.held_interrupt = None

    def poll(self) -> Poll:
        beats = self.script.pop(0)
        for beat in beats:
            self.run.put(layout.heartbeat(beat["rank"]), json.dumps(beat).encode())
        return Poll([ReplicaStatus(h.rank, "running") for h in self.handles], finished=not self.script)


@pytest.fixture(autouse=True)
def no_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(watch, "HEARTBEAT_POLL_S", 0.0)
    monkeypatch.setattr(watch, "LOCAL_STATUS_POLL_S", 0.0)


def watched(**diloco: object) -> tuple[RunConfig, ObjectStore]:
    """A tiny run's config with ``diloco`` settings, and a fresh store for its heartbeats."""
    config = validate_config(
        {"run_id": "w", "store": "memory://w", "model": {"tiny": TINY.model_dump()}, "diloco": diloco}
    )
    return config, ObjectStore(f"memory://watch-{uuid.uuid4().hex[:8]}")


def test_a_finished_replica_keeps_its_last_loss_on_screen() -> None:
    config, run = watched(replicas=1, sync_every=10, rounds=2)
    training = {"rank": 0, "state": "training", "round": 2, "step": 10, "loss": 2.5}
    done = {"rank": 0, "state": "done", "round": 2, "step": 10}
    out = io.StringIO()
    followed = watch.Followed(ScriptedSupervisor(run, [[training], [done]]), config)  # type: ignore[arg-type]
    console = Console(file=out, width=200)
    assert watch.follow([followed], watch.ReplicaView(followed, console), fail_fast=True)
    final = out.getvalue().strip().splitlines()[-1]
    assert "round 2/2" in final and "loss 2.500" in final and "done" in final, final


def test_a_decoupled_run_names_its_learners_and_its_syncer() -> None:
    """Two learners and the syncer (rank 2): each learner's bar counts its inner steps at the version it
    holds, the syncer's the versions it merged; none is called a replica, nothing says "round"."""
    config, run = watched(replicas=2, sync_every=10, rounds=4, mode="decoupled")
    beats = [
        {"rank": 0, "state": "training", "round": 3, "step": 5, "loss": 2.5},
        {"rank": 1, "state": "training", "round": 2, "step": 7, "loss": 2.75},
        {"rank": 2, "state": "waiting", "round": 2, "rounds": 4, "step": 0, "steps": 1},
    ]
    out = io.StringIO()
    supervisor = ScriptedSupervisor(run, [beats, beats], ranks=3)
    followed = watch.Followed(supervisor, config)  # type: ignore[arg-type]
    assert watch.follow([followed], watch.ReplicaView(followed, Console(file=out, width=200)), fail_fast=True)
    screen = out.getvalue().strip().splitlines()[-3:]
    learner0, learner1, syncer = (line.split() for line in screen)
    assert learner0[:2] == ["learner", "0"] and "25/40" in learner0 and "version 3/4" in screen[0]
    assert learner1[:2] == ["learner", "1"] and "17/40" in learner1 and "loss 2.750" in screen[1]
    assert syncer[0] == "syncer" and "2/4" in syncer and "version 2/4" in screen[2] and "waiting" in syncer
    assert "replica" not in out.getvalue() and "round" not in out.getvalue()
    followed.summary = {
        "rounds_committed": 4,
        "rounds": 4,
        "replicas": 2,
        "wall_s": 61.0,
        "final_eval_loss": 2.25,
        "initial_eval_loss": 3.5,
        "final_eval_reward": None,
        "replicas_bit_identical": True,
        "bytes_uploaded": 2e6,
        "bytes_downloaded": 4e6,
        "checkpoint_bytes_uploaded": 1e6,
    }
    report = io.StringIO()
    watch.print_report(followed, Console(file=report, width=200))
    lines = report.getvalue().strip().splitlines()
    assert lines[0] == "done: 4/4 versions merged for 2 learners in 61s"
    assert lines[2].startswith(
        "learners held the same bytes of every version they adopted: True; moved 2.0 MB up"
    )
