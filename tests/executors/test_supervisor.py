"""The launcher's policy, with a scripted executor: relaunch the dead up to the plan's budget, go on without a
replica that got no hardware, stop when cancelled elsewhere; Ctrl-C cancels or detaches as the user says."""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest
from rich.console import Console

from composer_serverless.config import validate_config
from composer_serverless.executors.base import (
    CostEstimate,
    LaunchPlan,
    LaunchRecord,
    ReplicaHandle,
    ReplicaSpec,
    ReplicaStatus,
    ServerlessExecutor,
)
from composer_serverless.launcher import follow
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.supervisor import RunCancelled, RunFailed, Supervisor
from tests.conftest import TINY


class ScriptedExecutor:
    """Answers ``status`` from a script of states per (rank, attempt); records launches and cancels."""

    name = "scripted"

    def __init__(self, script: dict[tuple[int, int], list[str]]) -> None:
        self.script = script
        self.launched: list[int] = []
        self.cancelled: list[str] = []

    def plan(self, config, run_url):  # pragma: no cover - the tests build plans by hand
        raise AssertionError

    def preflight(self, plan: LaunchPlan) -> list[str]:
        return []

    def launch(self, plan: LaunchPlan) -> list[ReplicaHandle]:
        self.launched += [s.rank for s in plan.replicas]
        attempt = self.launched.count(plan.replicas[0].rank)
        return [ReplicaHandle(s.rank, f"r{s.rank}a{attempt}", None, attempt) for s in plan.replicas]

    def status(self, handles: list[ReplicaHandle]) -> list[ReplicaStatus]:
        out = []
        for h in handles:
            states = self.script[(h.rank, int(h.backend_id.split("a")[1]))]
            state = states.pop(0) if len(states) > 1 else states[0]
            out.append(ReplicaStatus(h.rank, state, None if state != "failed" else 3, f"{state} detail"))
        return out

    def logs(self, handle: ReplicaHandle, follow: bool = False) -> Iterator[str]:
        yield from (f"{handle.backend_id} line {i}" for i in range(50))

    def cancel(self, handles: list[ReplicaHandle]) -> None:
        self.cancelled += [h.backend_id for h in handles]


def _supervisor(tmp_path, executor: ScriptedExecutor, replicas: int = 2, restarts: int = 1) -> Supervisor:
    assert isinstance(executor, ServerlessExecutor)
    specs = tuple(ReplicaSpec(r, ("worker", str(r))) for r in range(replicas))
    plan = LaunchPlan(
        "scripted", "run", "url", specs, CostEstimate(0, "free", 0, 0, 0), launcher_restarts=restarts
    )
    handles = executor.launch(plan)
    supervisor = Supervisor(ObjectStore(str(tmp_path / "run")), executor, LaunchRecord(plan, tuple(handles)))
    supervisor.save()
    return supervisor


def _until_finished(supervisor: Supervisor) -> list[str]:
    events = []
    while True:
        poll = supervisor.poll()
        events += poll.events
        if poll.finished:
            return events


def test_dead_replica_is_relaunched_and_recorded(tmp_path):
    executor = ScriptedExecutor(
        {(0, 1): ["running", "succeeded"], (1, 1): ["failed"], (1, 2): ["running", "succeeded"]}
    )
    supervisor = _supervisor(tmp_path, executor)
    events = _until_finished(supervisor)
    assert executor.launched == [0, 1, 1]
    assert events == ["replica 1 died (failed detail); started it again (attempt 2 of 2): r1a2"]
    saved = LaunchRecord.from_json(supervisor.run.get("launch.json"))
    assert [h.backend_id for h in saved.current()] == ["r0a1", "r1a2"]


def test_replica_that_keeps_failing_fails_the_run_with_its_log_tail(tmp_path):
    executor = ScriptedExecutor({(0, 1): ["running"], (1, 1): ["failed"], (1, 2): ["failed"]})
    supervisor = _supervisor(tmp_path, executor)
    with pytest.raises(RunFailed, match=r"replica 1 failed after 2 attempts \(failed detail\)") as failure:
        _until_finished(supervisor)
    assert "r1a2 line 49" in str(failure.value) and "r1a2 line 19" not in str(
        failure.value
    )  # the last 30 lines


def test_backend_that_retries_itself_gets_no_relaunch(tmp_path):
    executor = ScriptedExecutor({(0, 1): ["running"], (1, 1): ["failed"]})
    with pytest.raises(RunFailed, match="replica 1 failed"):
        _until_finished(_supervisor(tmp_path, executor, restarts=0))
    assert executor.launched == [0, 1]


def test_unscheduled_replica_is_cancelled_and_the_run_goes_on(tmp_path):
    executor = ScriptedExecutor(
        {(0, 1): ["running", "running", "succeeded"], (1, 1): ["pending", "unscheduled", "cancelled"]}
    )
    events = _until_finished(_supervisor(tmp_path, executor))
    assert executor.cancelled == ["r1a1"]
    assert events == [
        "replica 1 got no hardware (unscheduled detail); cancelled it, the run goes on without it"
    ]


def test_cancel_from_elsewhere_ends_the_watch(tmp_path):
    executor = ScriptedExecutor({(0, 1): ["running", "cancelled"], (1, 1): ["running", "cancelled"]})
    with pytest.raises(RunCancelled):
        _until_finished(_supervisor(tmp_path, executor))


def test_a_local_replica_killed_by_a_cancel_elsewhere_is_not_relaunched(tmp_path):
    executor = ScriptedExecutor({(0, 1): ["running", "failed"], (1, 1): ["running", "failed"]})
    supervisor = _supervisor(tmp_path, executor)
    supervisor.poll()
    other = _supervisor_view(supervisor)  # `cancel RUN` in another process marks the record first
    other.cancel()
    with pytest.raises(RunCancelled, match="cancelled from elsewhere"):
        supervisor.poll()
    assert executor.launched == [0, 1]


@pytest.mark.parametrize(("answer", "cancelled"), [("detach", False), ("cancel", True)])
def test_ctrl_c_asks_whether_to_cancel_or_detach(tmp_path, answer, cancelled):
    class Interrupted(ScriptedExecutor):
        def status(self, handles):
            raise KeyboardInterrupt

    executor = Interrupted({})
    supervisor = _supervisor(tmp_path, executor)
    config = validate_config(
        {"model": {"tiny": TINY.model_dump()}, "diloco": {"replicas": 2, "sync_every": 2, "rounds": 1}}
    )
    out = io.StringIO()
    if cancelled:
        with pytest.raises(RunCancelled):
            follow(supervisor, config, Console(file=out), on_interrupt=lambda: answer)
        assert executor.cancelled == ["r0a1", "r1a1"]
        assert LaunchRecord.from_json(supervisor.run.get("launch.json")).cancelled
    else:
        assert follow(supervisor, config, Console(file=out), on_interrupt=lambda: answer) is None
        assert executor.cancelled == [] and "detached: the replicas keep running" in out.getvalue()


def _supervisor_view(supervisor: Supervisor) -> Supervisor:
    return Supervisor(
        supervisor.run, supervisor.executor, LaunchRecord.from_json(supervisor.run.get("launch.json"))
    )
