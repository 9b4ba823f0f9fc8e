"""One run's replicas as the launcher sees them: poll, relaunch the dead, give up on the unschedulable.

The supervisor owns the run's launch record (``launch.json``): every relaunch appends the new attempt's
handle, so ``status``, ``logs`` and ``cancel`` from another process always address the live attempt.

Policy, per replica:

* ``failed``: started again with the same command while the plan's ``launcher_restarts`` allows (backends
  that retry by themselves, Modal, allow 0 here); after that the run fails with the end of the replica's log.
  The replica rejoins the run from the store.
* ``unscheduled`` (no hardware before the backend's scheduling deadline): cancelled, reported, and the run
  goes on without it; the run fails only if no replica is left.
* ``cancelled`` by someone else (``cancel RUN`` from another terminal): the run is over.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from composer_serverless.executors.base import (
    TERMINAL_STATES,
    LaunchRecord,
    ReplicaHandle,
    ReplicaStatus,
    ServerlessExecutor,
)
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import ObjectStore

LOG_TAIL_LINES = 30


class RunFailed(RuntimeError):
    """A replica failed for good, or none could be scheduled; the message carries the end of its log."""


class RunCancelled(RuntimeError):
    """The run's replicas were cancelled, here or from another process."""


class Terminated(BaseException):
    """The launcher was told to stop (SIGTERM) while it watched a run: cancel the replicas, then exit.

    A BaseException, as KeyboardInterrupt is: it can be raised at any line of the launcher, and no
    ``except Exception`` on the way (a store retry, a best-effort write) may swallow it.
    """

    message = "the launcher was sent SIGTERM; its replicas were cancelled"


@dataclass
class Poll:
    """What one poll saw: a status per replica, lines worth telling the user, and whether the run is over."""

    statuses: list[ReplicaStatus]
    events: list[str] = field(default_factory=list)
    finished: bool = False


class Supervisor:
    def __init__(self, run: ObjectStore, executor: ServerlessExecutor, record: LaunchRecord) -> None:
        self.run = run
        self.executor = executor
        self.record = record
        self._given_up: dict[int, str] = {}  # rank -> why the run goes on without it

    @property
    def handles(self) -> list[ReplicaHandle]:
        return self.record.current()

    def save(self) -> None:
        self.run.put(layout.LAUNCH_RECORD, self.record.to_json())

    def poll(self) -> Poll:
        handles = self.handles
        statuses = self.executor.status(handles)
        events: list[str] = []
        for handle, status in zip(handles, statuses, strict=True):
            if status.state == "failed":
                events.append(self._relaunch_or_fail(handle, status))
            elif status.state == "unscheduled" and handle.rank not in self._given_up:
                self.executor.cancel([handle])
                self._given_up[handle.rank] = f"got no hardware ({status.detail})"
                events.append(
                    f"replica {handle.rank} {self._given_up[handle.rank]}; "
                    "cancelled it, the run goes on without it"
                )
            elif status.state == "cancelled" and handle.rank not in self._given_up:
                raise RunCancelled(
                    f"replica {handle.rank} was cancelled ({status.detail or 'from elsewhere'})"
                )
        if events:
            statuses = self.executor.status(self.handles)
        finished = all(s.state in TERMINAL_STATES for s in statuses)
        if finished and not any(s.state == "succeeded" for s in statuses):
            why = [
                f"replica {s.rank} {self._given_up.get(s.rank, s.state + ': ' + s.detail)}" for s in statuses
            ]
            raise RunFailed("no replica ran: " + "; ".join(why))
        return Poll(statuses, events, finished)

    def _relaunch_or_fail(self, handle: ReplicaHandle, status: ReplicaStatus) -> str:
        if LaunchRecord.from_json(self.run.get(layout.LAUNCH_RECORD)).cancelled:
            raise RunCancelled("the run was cancelled from elsewhere (`cancel RUN`)")
        restarts = self.record.plan.launcher_restarts
        if handle.attempt > restarts:
            tried = f" after {handle.attempt} attempts" if handle.attempt > 1 else ""
            raise RunFailed(
                f"replica {handle.rank} failed{tried} ({status.detail}); "
                f"last lines of its log ({handle.log}):\n"
                + "\n".join(self.log_tail(handle))
                + f"\nthe run can continue from its latest state: composer-serverless launch --resume {self.run.url}"
            )
        (new,) = self.executor.launch(self.record.plan.only(handle.rank))
        new = dataclasses.replace(new, attempt=handle.attempt + 1)
        self.record = self.record.with_handles(new)
        self.save()
        return (
            f"replica {handle.rank} died ({status.detail}); started it again "
            f"(attempt {new.attempt} of {restarts + 1}): {new.backend_id}"
        )

    def log_tail(self, handle: ReplicaHandle, lines: int = LOG_TAIL_LINES) -> list[str]:
        try:
            return list(self.executor.logs(handle))[-lines:]
        except Exception as e:  # the log is a courtesy here; the failure itself is already known
            return [f"(log unavailable: {type(e).__name__}: {e})"]

    def cancel(self) -> None:
        """Record the cancellation first (so no watcher takes dying replicas for failures), then cancel."""
        self.record = dataclasses.replace(self.record, cancelled=True)
        self.save()
        self.executor.cancel(self.handles)
