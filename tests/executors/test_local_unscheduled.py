"""The local executor's benchmark seam: a launch of a rank can be answered "no hardware" on request, as a cloud
backend answers past its scheduling deadline, so the chaos benchmark can play it on local processes."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from composer_serverless.executors.base import (
    CostEstimate,
    LaunchPlan,
    LaunchRecord,
    ReplicaHandle,
    ReplicaSpec,
)
from composer_serverless.executors.local import UNSCHEDULED_ENV, LocalProcessExecutor
from composer_serverless.rendezvous.store import ObjectStore


class Journal:
    def __init__(self) -> None:
        self.attempts: dict[int, int] = {}

    def launching(self, rank: int, meta: dict[str, str]) -> ReplicaHandle:
        self.attempts[rank] = self.attempts.get(rank, 0) + 1
        return ReplicaHandle(rank, "", attempt=self.attempts[rank], meta=dict(meta))

    def launched(self, handle: ReplicaHandle) -> None:
        return None


def test_a_requested_launch_gets_no_hardware_once(tmp_path: Path, monkeypatch) -> None:
    """A file named after rank 1 in the requests directory: rank 1's launch starts no process and reads
    ``unscheduled`` until it is cancelled, then ``cancelled``, as a cloud job cancelled while it waited for
    hardware does, also to another executor (a ``--resume`` after the launcher died waits for exactly that).
    The request is spent: its next launch starts a process. Rank 0 is started as always."""
    requests = tmp_path / "requests"
    requests.mkdir()
    (requests / "1").touch()
    monkeypatch.setenv(UNSCHEDULED_ENV, str(requests))
    specs = tuple(ReplicaSpec(rank, (sys.executable, "-c", "pass")) for rank in (0, 1))
    plan = LaunchPlan("local", "run", "url", specs, CostEstimate(0, "free", 0, 0, 0))
    executor = LocalProcessExecutor(ObjectStore(str(tmp_path / "run")), tmp_path / "logs")
    journal = Journal()
    started, denied = executor.launch(plan, journal)
    assert started.backend_id.isdigit() and denied.backend_id == "unscheduled-1-1"
    assert not (requests / "1").exists()
    (status,) = executor.status([denied])
    assert (status.state, status.detail) == ("unscheduled", f"no hardware, as {UNSCHEDULED_ENV} asked")
    executor.cancel([denied], grace_s=0.1)
    elsewhere = LocalProcessExecutor(ObjectStore(str(tmp_path / "run")), tmp_path / "logs")
    assert executor.status([denied])[0].state == elsewhere.status([denied])[0].state == "cancelled"
    executor.cancel_run(LaunchRecord(plan, (started, denied)), grace_s=0.1)
    (again,) = executor.launch(dataclasses.replace(plan, replicas=specs[1:]), journal)
    assert again.backend_id.isdigit() and again.attempt == 2
    executor.cancel_run(LaunchRecord(plan, (started, denied, again)), grace_s=0.1)
