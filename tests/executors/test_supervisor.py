"""The launcher's policy, with a scripted executor: relaunch the dead up to the plan's budget, go on without a
replica that got no hardware, stop when cancelled elsewhere; Ctrl-C cancels or detaches as the user says."""

from __future__ import annotations

import dataclasses
import io
import json
import re
from collections.abc import Iterator

import pytest
from rich.console import Console

from composer_serverless.config import validate_config
from composer_serverless.executors import base
from composer_serverless.executors.base import (
    CostEstimate,
    Journal,
    LaunchPlan,
    LaunchRecord,
    ReplicaHandle,
    ReplicaSpec,
    ReplicaStatus,
    ServerlessExecutor,
)
from composer_serverless.launch.launcher import follow
from composer_serverless.launch.supervisor import RunCancelled, RunFailed, Supervisor
from composer_serverless.rendezvous import layout, recovery
from composer_serverless.rendezvous.store import ObjectStore
from tests.conftest import TINY


class ScriptedExecutor:
    """Answers ``status`` from a script of states per (rank, attempt); records launches and cancels.

    With ``ending`` set, a cancelled attempt reads as scripted for ``ending`` more polls, then "cancelled" (a
    backend takes a moment to stop a job); without, cancelling changes nothing the script says. The script's
    last state repeats.
    """

    name = "scripted"

    def __init__(self, script: dict[tuple[int, int], list[str]], ending: int | None = None) -> None:
        self.script = script
        self.ending = ending
        self.launched: list[int] = []
        self.cancelled: list[str] = []
        self.polled_after_cancel: dict[str, int] = {}

    def plan(self, config, run_url):  # pragma: no cover - the tests build plans by hand
        raise AssertionError

    def preflight(self, plan: LaunchPlan) -> list[str]:
        return []

    def check_access(self, plan: LaunchPlan) -> None:
        return None

    def launch(self, plan: LaunchPlan, journal: Journal) -> list[ReplicaHandle]:
        handles = []
        for spec in plan.replicas:
            self.launched.append(spec.rank)
            pending = journal.launching(spec.rank, {})
            handle = dataclasses.replace(pending, backend_id=f"r{spec.rank}a{pending.attempt}")
            journal.launched(handle)
            handles.append(handle)
        return handles

    def status(self, handles: list[ReplicaHandle]) -> list[ReplicaStatus]:
        out = []
        for h in handles:
            if self.ending is not None and h.backend_id in self.cancelled:
                polls = self.polled_after_cancel[h.backend_id] = (
                    self.polled_after_cancel.get(h.backend_id, 0) + 1
                )
                if polls > self.ending:
                    out.append(ReplicaStatus(h.rank, "cancelled", None, "cancelled"))
                    continue
            states = self.script[(h.rank, h.attempt)]
            state = states.pop(0) if len(states) > 1 else states[0]
            out.append(ReplicaStatus(h.rank, state, None if state != "failed" else 3, f"{state} detail"))
        return out

    def logs(self, handle: ReplicaHandle, follow: bool = False, tail: int | None = None) -> Iterator[str]:
        lines = [f"{handle.backend_id} line {i}" for i in range(50)]
        yield from lines[-tail:] if tail else lines

    def cancel(self, handles: list[ReplicaHandle]) -> None:
        self.cancelled += [h.backend_id for h in handles]

    def cancel_run(self, record: LaunchRecord) -> None:
        self.cancel(list(record.handles))


def _supervisor(tmp_path, executor: ScriptedExecutor, replicas: int = 2, restarts: int = 1) -> Supervisor:
    assert isinstance(executor, ServerlessExecutor)
    specs = tuple(ReplicaSpec(r, ("worker", str(r))) for r in range(replicas))
    plan = LaunchPlan(
        "scripted", "run", "url", specs, CostEstimate(0, "free", 0, 0, 0), launcher_restarts=restarts
    )
    supervisor = Supervisor(ObjectStore(str(tmp_path / "run")), executor, LaunchRecord(plan, ()))
    supervisor.save()
    supervisor.start(plan, note=lambda line: None)
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
    assert [h.backend_id for h in saved.handles] == ["r0a1", "r1a1", "r1a2"]  # every attempt kept


def test_a_replica_reported_dead_is_relaunched_only_once_its_attempt_is_seen_ended(tmp_path, monkeypatch):
    """Reported failed, but still running (a listing that missed it): it is cancelled and polled until the
    backend says it ended, and only then started again; never two attempts of one rank alive at once."""
    from composer_serverless.launch import supervisor as supervisor_module

    monkeypatch.setattr(supervisor_module, "GONE_POLL_S", 0.0)
    executor = ScriptedExecutor(
        {(0, 1): ["running", "succeeded"], (1, 1): ["failed", "running"], (1, 2): ["succeeded"]}, ending=3
    )
    supervisor = _supervisor(tmp_path, executor)
    _until_finished(supervisor)
    assert executor.cancelled == ["r1a1"] and executor.polled_after_cancel == {"r1a1": 4}
    assert executor.launched == [0, 1, 1]


def test_an_unscheduled_attempt_is_not_taken_for_ended(tmp_path, monkeypatch):
    """`unscheduled` is past a deadline, not over: a job still SCHEDULING may get hardware. Restarting its
    rank waits until the backend says the cancelled attempt ended."""
    from composer_serverless.launch import supervisor as supervisor_module

    monkeypatch.setattr(supervisor_module, "GONE_POLL_S", 0.0)
    executor = ScriptedExecutor({(0, 1): ["running"], (1, 1): ["unscheduled"], (1, 2): ["running"]}, ending=2)
    supervisor = _supervisor(tmp_path, executor)
    (handle,) = [h for h in supervisor.handles if h.rank == 1]
    supervisor.restart([handle], note=lambda line: None)
    assert executor.polled_after_cancel == {"r1a1": 3} and executor.launched == [0, 1, 1]


def test_a_replica_that_will_not_end_is_not_started_twice(tmp_path, monkeypatch):
    from composer_serverless.launch import supervisor as supervisor_module

    monkeypatch.setattr(supervisor_module, "GONE_POLL_S", 0.0)
    monkeypatch.setattr(supervisor_module, "GONE_TIMEOUT_S", 0.0)
    executor = ScriptedExecutor({(0, 1): ["running"], (1, 1): ["failed", "running"]}, ending=10**6)
    supervisor = _supervisor(tmp_path, executor)
    with pytest.raises(RunFailed, match="still running .* not starting a second one"):
        supervisor.poll()
    assert executor.launched == [0, 1]


def test_replica_that_keeps_failing_fails_the_run_with_its_log_tail(tmp_path):
    executor = ScriptedExecutor({(0, 1): ["running"], (1, 1): ["failed"], (1, 2): ["failed"]})
    supervisor = _supervisor(tmp_path, executor)
    with pytest.raises(RunFailed, match=r"replica 1 failed after 2 attempts \(failed detail\)") as failure:
        _until_finished(supervisor)
    assert "r1a2 line 49" in str(failure.value) and "r1a2 line 19" not in str(
        failure.value
    )  # the last 30 lines


def _resumed(tmp_path, executor: ScriptedExecutor, earlier: list[tuple[int, int]], start: bool) -> Supervisor:
    """A supervisor of a resumed run whose launch.json holds the (rank, attempt)s of ``earlier`` launches, one
    restart allowed; with ``start``, it starts every replica again (a resume that rolled back), else it
    watches the latest attempts as they run (a resume that adopted them)."""
    specs = tuple(ReplicaSpec(r, ("worker", str(r))) for r in range(2))
    plan = LaunchPlan("scripted", "run", "url", specs, CostEstimate(0, "free", 0, 0, 0), launcher_restarts=1)
    handles = tuple(ReplicaHandle(rank, f"r{rank}a{attempt}", attempt=attempt) for rank, attempt in earlier)
    supervisor = Supervisor(ObjectStore(str(tmp_path / "run")), executor, LaunchRecord(plan, handles))
    supervisor.save()
    if start:
        supervisor.start(plan, note=lambda line: None)
    return supervisor


def test_a_resumed_run_gets_its_restarts_again(tmp_path):
    """Attempt numbers go on across resumes; the restart budget counts the restarts of this launch."""
    executor = ScriptedExecutor(
        {(0, 3): ["running", "succeeded"], (1, 4): ["failed"], (1, 5): ["running", "succeeded"]}
    )
    earlier = [(0, 1), (0, 2), (1, 1), (1, 2), (1, 3)]
    events = _until_finished(_resumed(tmp_path, executor, earlier, start=True))
    assert events == ["replica 1 died (failed detail); started it again (attempt 2 of 2): r1a5"]

    executor = ScriptedExecutor({(0, 3): ["running"], (1, 4): ["failed"], (1, 5): ["failed"]})
    with pytest.raises(RunFailed, match=r"replica 1 failed after 2 attempts \(failed detail\)"):
        _until_finished(_resumed(tmp_path, executor, earlier, start=True))


def test_an_adopted_replica_gets_the_restarts_of_this_launch(tmp_path):
    executor = ScriptedExecutor(
        {(0, 2): ["running", "succeeded"], (1, 3): ["failed"], (1, 4): ["running", "succeeded"]}
    )
    supervisor = _resumed(tmp_path, executor, [(0, 1), (0, 2), (1, 1), (1, 2), (1, 3)], start=False)
    events = _until_finished(supervisor)
    assert events == ["replica 1 died (failed detail); started it again (attempt 2 of 2): r1a4"]
    assert executor.launched == [1]


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


def test_a_replica_given_up_holds_no_round_until_it_is_started_again(tmp_path):
    """Rank 1 was killed while training (its last heartbeat says so) and its restart got no hardware: the
    supervisor cancels it and records that it gave it up, so a replica waiting for a round no longer counts it
    among those that may publish it (else it would wait diloco.sync_timeout_s for it, again and again). A
    resume that starts rank 1 again removes the record."""
    executor = ScriptedExecutor(
        {(0, 1): ["running"], (1, 1): ["unscheduled", "cancelled"], (1, 2): ["running"]}
    )
    supervisor = _supervisor(tmp_path, executor)
    run = supervisor.run
    run.put(layout.heartbeat(1), json.dumps({"rank": 1, "state": "training", "round": 4}).encode())
    assert recovery.holders(run, 0, 2) == [1]
    supervisor.poll()
    assert recovery.holders(run, 0, 2) == []
    given_up = json.loads(run.get(layout.given_up(1)))
    assert {k: given_up[k] for k in ("rank", "attempt", "why")} == {
        "rank": 1,
        "attempt": 1,
        "why": "got no hardware (unscheduled detail)",
    }
    supervisor.start(supervisor.record.plan.only({1}), note=lambda line: None)
    assert not run.exists(layout.given_up(1)) and recovery.holders(run, 0, 2) == [1]


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
        assert sorted(executor.cancelled) == ["r0a1", "r1a1"]
        assert LaunchRecord.from_json(supervisor.run.get("launch.json")).cancelled
    else:
        assert follow(supervisor, config, Console(file=out), on_interrupt=lambda: answer) is None
        assert executor.cancelled == [] and "detached: the replicas keep running" in out.getvalue()


def _supervisor_view(supervisor: Supervisor) -> Supervisor:
    return Supervisor(
        supervisor.run, supervisor.executor, LaunchRecord.from_json(supervisor.run.get("launch.json"))
    )


def _decoupled_supervisor(tmp_path, executor: ScriptedExecutor, shards: int) -> Supervisor:
    """A started decoupled run of 2 learners and a syncer of ``shards`` shards (ranks 2, ...), its plan's
    syncer resources as every executor builds them."""
    config = validate_config(
        {
            "model": {"tiny": TINY.model_dump()},
            "diloco": {
                "replicas": 2,
                "sync_every": 2,
                "rounds": 1,
                "mode": "decoupled",
                "embedding_average": "all",
                "decoupled": {"syncer_shards": shards},
            },
        }
    )
    ranks = [*range(2), *config.diloco.syncer_ranks]
    specs = tuple(ReplicaSpec(r, ("worker", str(r))) for r in ranks)
    syncer = base.syncer_resources(config, hardware="a CPU")
    plan = LaunchPlan("scripted", "run", "url", specs, CostEstimate(0, "free", 0, 0, 0), {"syncer": syncer})
    supervisor = Supervisor(ObjectStore(str(tmp_path / "run")), executor, LaunchRecord(plan, ()))
    supervisor.save()
    supervisor.start(plan, note=lambda line: None)
    return supervisor


@pytest.mark.parametrize(
    ("shards", "unscheduled", "which"),
    [
        (1, 2, "the syncer (rank 2)"),
        (2, 2, "the syncer's shard 0 (rank 2)"),
        (2, 3, "the syncer's shard 1 (rank 3)"),
    ],
)
def test_a_syncer_shard_that_got_no_hardware_fails_the_run(tmp_path, shards, unscheduled, which):
    """A learner without hardware is given up and the run goes on; any shard of the syncer without hardware
    fails the run, as the single syncer does: the learners would wait for merges of its fragment."""
    script = {(rank, 1): ["running"] for rank in range(2 + shards)}
    script[(unscheduled, 1)] = ["unscheduled"]
    with pytest.raises(RunFailed, match=rf"^{re.escape(which)} got no hardware \(unscheduled detail\)"):
        _decoupled_supervisor(tmp_path / "syncer", ScriptedExecutor(script), shards).poll()

    script = {(rank, 1): ["running"] for rank in range(2 + shards)}
    script[(1, 1)] = ["unscheduled"]
    poll = _decoupled_supervisor(tmp_path / "learner", ScriptedExecutor(script), shards).poll()
    assert poll.events == [
        "replica 1 got no hardware (unscheduled detail); cancelled it, the run goes on without it"
    ]
