"""The launcher's progress display, driven by heartbeats in the store and a scripted supervisor."""

from __future__ import annotations

import io
import json
import uuid
from types import SimpleNamespace

from rich.console import Console

from composer_serverless.config import validate_config
from composer_serverless.executors.base import ReplicaStatus
from composer_serverless.launch import watch
from composer_serverless.launch.supervisor import Poll
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import ObjectStore
from tests.conftest import TINY


class ScriptedSupervisor:
    """Runs the heartbeats it is given, one list per poll; the run is finished after the last."""

    def __init__(self, run: ObjectStore, script: list[list[dict]]) -> None:
        self.run = run
        self.script = script
        self.handles = [SimpleNamespace(rank=0)]
        self.held_interrupt = None

    def poll(self) -> Poll:
        beats = self.script.pop(0)
        for beat in beats:
            self.run.put(layout.heartbeat(beat["rank"]), json.dumps(beat).encode())
        return Poll([ReplicaStatus(0, "running")], finished=not self.script)


def test_a_finished_replica_keeps_its_last_loss_on_screen(monkeypatch) -> None:
    monkeypatch.setattr(watch, "HEARTBEAT_POLL_S", 0.0)
    monkeypatch.setattr(watch, "LOCAL_STATUS_POLL_S", 0.0)
    config = validate_config(
        {
            "run_id": "w",
            "store": "memory://w",
            "model": {"tiny": TINY.model_dump()},
            "diloco": {"replicas": 1, "sync_every": 10, "rounds": 2},
        }
    )
    run = ObjectStore(f"memory://watch-{uuid.uuid4().hex[:8]}")
    training = {"rank": 0, "state": "training", "round": 2, "step": 10, "loss": 2.5}
    done = {"rank": 0, "state": "done", "round": 2, "step": 10}
    out = io.StringIO()
    followed = watch.Followed(ScriptedSupervisor(run, [[training], [done]]), config)  # type: ignore[arg-type]
    console = Console(file=out, width=200)
    assert watch.follow([followed], watch.ReplicaView(followed, console), fail_fast=True)
    final = out.getvalue().strip().splitlines()[-1]
    assert "round 2/2" in final and "loss 2.500" in final and "done" in final, final
