"""One run's replicas as the launcher sees them: poll, relaunch the dead, give up on the unschedulable.

The supervisor owns the run's launch record (``launch.json``) and is the executors' ``Journal``: every
attempt is written there before the backend is asked to create it and again once it has an id, so
``status``, ``logs`` and ``cancel`` from another process always find every attempt, the live one included.

Policy, per replica:

* ``failed``: started again with the same command while the plan's ``launcher_restarts`` allows (backends
  that retry by themselves, Modal, allow 0 here); after that the run fails with the end of the replica's log.
  The budget counts the restarts of this launch: attempt numbers go on across resumes (``launch.json`` keeps
  every attempt), but a resume gives every replica its restarts again.
  The replica rejoins the run from the store. The failed attempt is cancelled, and seen ended, first: a
  replica reported failed by mistake (a listing that missed it) must not end up running twice.
* ``unscheduled`` (no hardware before the backend's scheduling deadline): cancelled, reported, and the run
  goes on without it; the run fails only if no replica is left. The store records that it was given up
  (``layout.given_up``): its last heartbeat may still say "training", and the other replicas must not count
  on it to publish a round they wait for (``recovery.holders``). Starting the rank again removes the record.
  A decoupled run's syncer, or any one of its shards, is never given up: the run fails instead (its learners
  would wait for merges, of every fragment or of that shard's).
* ``cancelled`` by someone else (``cancel RUN`` from another terminal): the run is over.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from composer_serverless.executors.base import (
    TERMINAL_STATES,
    LaunchPlan,
    LaunchRecord,
    ReplicaHandle,
    ReplicaStatus,
    ServerlessExecutor,
)
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import read_heartbeats

LOG_TAIL_LINES = 30
# How long a cancelled attempt may take to be seen ended before its rank is started again; past it the run
# fails rather than risk two live attempts of one rank.
GONE_TIMEOUT_S = 120.0
GONE_POLL_S = 1.0
# What an attempt reads once it has really ended: ``unscheduled`` ends a replica's part in the run (it goes on
# without it), but its job may still be waiting for hardware.
ENDED_STATES = TERMINAL_STATES - {"unscheduled"}


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


@contextlib.contextmanager
def sigterm_cancels() -> Iterator[None]:
    """Make SIGTERM (``kill``, ``timeout``, a CI job or a scheduler stopping the caller) cancel the replicas
    that a launch starts, as Ctrl-C with nobody to answer does.

    Local replicas run in their own sessions, so that a Ctrl-C meant for the launcher does not kill them
    before the user chooses; SIGTERM's default action would end the caller without a word and leave them
    training (and cloud replicas billing). Raised as ``Terminated``, it goes through the watch's cleanup,
    which cancels every replica started (and records the cancellation, for ``status``). ``launch``,
    ``resume`` and ``run_sweep`` install it themselves, so every caller has it: the CLI (which also installs
    it from its start, for the work before a launch), the benchmarks, a user's own script. A handler the caller set (anything but the default, ignoring included) is theirs and
    stays; outside the main thread, where signals cannot be caught, nothing is installed.
    """
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return

    def terminate(signum: int, frame: object) -> None:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def interrupts_held(note: Callable[[str], None]) -> Iterator[list[BaseException]]:
    """Hold Ctrl-C and SIGTERM while replicas are being created, so that no replica is created and then
    forgotten half-way through its recording; a second signal acts at once.

    Yields the list that receives the held interrupt (a KeyboardInterrupt or a ``Terminated``); the caller
    raises it once what was started is recorded, where the user's choice (cancel or detach) is taken. In a
    thread other than the main one (where signals cannot be caught) nothing is held.
    """
    held: list[BaseException] = []
    if threading.current_thread() is not threading.main_thread():
        yield held
        return

    def hold(signum: int, frame: object) -> None:
        interrupt = KeyboardInterrupt() if signum == signal.SIGINT else Terminated()
        if held:
            raise interrupt
        held.append(interrupt)
        note(
            "finishing the creation of the replica being started so that it is recorded; signal again to stop at once"
        )

    previous = {sig: signal.signal(sig, hold) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield held
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


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
        # rank -> its first attempt of this launch (one it started, or one it adopted running): the restart
        # budget counts from there, since attempt numbers go on across resumes.
        self._first_attempt: dict[int, int] = {}
        # An interrupt held while replicas were being created: raised where the watch can act on it.
        self.held_interrupt: BaseException | None = None

    @property
    def handles(self) -> list[ReplicaHandle]:
        return self.record.current()

    def save(self) -> None:
        self.run.put(layout.LAUNCH_RECORD, self.record.to_json())

    # --- the executors' Journal ----------------------------------------------------------------------

    def launching(self, rank: int, meta: dict[str, str]) -> ReplicaHandle:
        self.run.delete(layout.given_up(rank))  # started again: it may hold rounds once it trains
        handle = ReplicaHandle(rank, "", attempt=self.record.next_attempt(rank), meta=dict(meta))
        self._first_attempt.setdefault(rank, handle.attempt)
        self.launched(handle)
        return handle

    def launched(self, handle: ReplicaHandle) -> None:
        self.record = self.record.with_handle(handle)
        self.save()

    def start(self, plan: LaunchPlan, note: Callable[[str], None]) -> list[ReplicaHandle]:
        """Create ``plan``'s replicas through the executor, each recorded before and after; Ctrl-C and
        SIGTERM are held meanwhile (``held_interrupt``). If creating fails, or a second signal stops it,
        every attempt this call recorded is cancelled: nothing started may be left running unwatched."""
        earlier = {(h.rank, h.attempt) for h in self.record.handles}
        with interrupts_held(note) as held:
            try:
                handles = self.executor.launch(plan, self)
            except BaseException:
                self.executor.cancel([h for h in self.record.handles if (h.rank, h.attempt) not in earlier])
                raise
        if held:
            self.held_interrupt = held[0]
        return handles

    def poll(self) -> Poll:
        handles = self.handles
        statuses = self.executor.status(handles)
        events: list[str] = []
        for handle, status in zip(handles, statuses, strict=True):
            if status.state == "failed":
                events.append(self._relaunch_or_fail(handle, status))
            elif status.state == "unscheduled" and handle.rank not in self._given_up:
                self._no_syncer_without_hardware(handle, status)
                self._give_up(handle, f"got no hardware ({status.detail})")
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

    def _no_syncer_without_hardware(self, handle: ReplicaHandle, status: ReplicaStatus) -> None:
        """A run goes on without a learner that got no hardware, never without its syncer or any shard of it
        (decoupled mode): the learners would wait for merges that never come."""
        shards = self.record.plan.syncer_ranks
        if handle.rank not in shards:
            return
        which = "the syncer" if len(shards) == 1 else f"the syncer's shard {shards.index(handle.rank)}"
        raise RunFailed(
            f"{which} (rank {handle.rank}) got no hardware ({status.detail}); without it no contribution "
            f"is merged\n  fix: a CPU flavor with hardware free (executor.syncer_flavor) or a longer "
            f"executor.scheduling_deadline_s, then launch --resume {self.run.url}"
        )

    def _give_up(self, handle: ReplicaHandle, why: str) -> None:
        """Cancel ``handle`` and record in the store that the run goes on without its rank."""
        self.executor.cancel([handle])
        self._given_up[handle.rank] = why
        record = {"rank": handle.rank, "attempt": handle.attempt, "why": why, "time": time.time()}
        self.run.put(layout.given_up(handle.rank), json.dumps(record).encode())

    def _relaunch_or_fail(self, handle: ReplicaHandle, status: ReplicaStatus) -> str:
        if LaunchRecord.from_json(self.run.get(layout.LAUNCH_RECORD)).cancelled:
            raise RunCancelled("the run was cancelled from elsewhere (`cancel RUN`)")
        restarts = self.record.plan.launcher_restarts
        tries = handle.attempt - self._first_attempt.setdefault(handle.rank, handle.attempt) + 1
        if tries > restarts:
            tried = f" after {tries} attempts" if tries > 1 else ""
            raise RunFailed(
                f"replica {handle.rank} failed{tried} ({status.detail}); "
                f"last lines of its log ({handle.log}):\n"
                + "\n".join(self.log_tail(handle))
                + "\n"
                + self._way_on(handle.rank)
            )
        (new,) = self.restart([handle], note=lambda line: None)
        return (
            f"replica {handle.rank} died ({status.detail}); started it again "
            f"(attempt {tries + 1} of {restarts + 1}): {new.backend_id}"
        )

    def _way_on(self, rank: int) -> str:
        """What to do after replica ``rank`` failed for good: fix the user's code first where it failed there
        (its final heartbeat names the line: ``objectives/user_code.py``), since a resume with the same code
        fails the same way; else resume."""
        try:
            beat = read_heartbeats(self.run).get(rank, {})
        except Exception:  # a courtesy, as the log's tail is: the failure itself is already known
            beat = {}
        where = beat.get("user_code") if beat.get("state") == "failed" else None
        resume = f"composer-serverless launch --resume {self.run.url}"
        if not where:
            return f"the run can continue from its latest state: {resume}"
        return (
            f"it failed in your code, at {where} ({beat.get('error', 'see the log')})\n"
            f"  fix: fix {where} first (a resume with the code as it is fails the same way), then "
            f"{resume} --set code.accept_changes=true"
        )

    def restart(self, handles: list[ReplicaHandle], note: Callable[[str], None]) -> list[ReplicaHandle]:
        """Start the ranks of ``handles`` again, each only once its attempt is cancelled and seen ended."""
        self.end(handles)
        return self.start(self.record.plan.only({handle.rank for handle in handles}), note)

    def end(self, handles: list[ReplicaHandle]) -> None:
        """Cancel each attempt of ``handles`` and wait until the backend reports it ended.

        Raises:
            RunFailed: one still runs after ``GONE_TIMEOUT_S``: starting its rank again would run it twice.
        """
        for handle in handles:
            self.executor.cancel([handle])
            deadline = time.monotonic() + GONE_TIMEOUT_S
            while (state := self.executor.status([handle])[0].state) not in ENDED_STATES:
                if time.monotonic() > deadline:
                    raise RunFailed(
                        f"replica {handle.rank}'s attempt {handle.attempt} "
                        f"({handle.backend_id or 'being created'}) is still {state} {GONE_TIMEOUT_S:.0f} s after "
                        "it was cancelled; not starting a second one beside it\n"
                        f"  fix: composer-serverless cancel {self.run.url}, then launch --resume {self.run.url}"
                    )
                time.sleep(GONE_POLL_S)

    def log_tail(self, handle: ReplicaHandle, lines: int = LOG_TAIL_LINES) -> list[str]:
        try:
            return list(self.executor.logs(handle, tail=lines))[-lines:]
        except Exception as e:  # the log is a courtesy here; the failure itself is already known
            return [f"(log unavailable: {type(e).__name__}: {e})"]

    def cancel(self) -> None:
        """Record the cancellation first (so no watcher takes dying replicas for failures), then end every
        attempt of the run the backend holds."""
        self.record = dataclasses.replace(self.record, cancelled=True)
        self.save()
        self.executor.cancel_run(self.record)
