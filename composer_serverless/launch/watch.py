"""Following started runs to their end: the one path ``launch`` and ``sweep`` share.

Progress comes from the heartbeats in the store (every ``HEARTBEAT_POLL_S``, or as often as a live run's
backend is asked, if that is more often: local runs); each run's backend is asked for its replicas' states
only every ``executor.status_poll_s``, since on a cloud backend each ask is a rate-limited call. A backend that fails to answer for a while (rate limits, outages) is said once and asked
again at the next poll: the replicas do not need the launcher; one that refuses for good (a revoked token)
ends the watch, leaving the replicas running, with how to reach them. Whatever ends the watch early, nothing is left billing: Ctrl-C asks whether to cancel the
replicas or detach from them (a detached run keeps going; ``status``, ``logs`` and ``cancel`` reach it through
its URL), SIGTERM (``Terminated``) cancels them, and any other failure cancels them too. A run that fails while
others go on (a sweep cell) is cancelled and marked; with ``fail_fast`` (a single launch) its failure ends the
watch. A launch shows a bar per replica; a sweep a bar per run (``ReplicaView``, ``RunView``). A run with a
live harvest is harvested between its rounds while it is watched (``harvest/live.py``), and no longer once
the watch ends, a detach included.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeRemainingColumn,
)

from composer_serverless.config import RunConfig
from composer_serverless.executors.base import BackendError
from composer_serverless.harvest.live import LiveHarvester
from composer_serverless.launch.report import eval_headline, outcome, progress_figure, speed, write_report
from composer_serverless.launch.supervisor import RunCancelled, RunFailed, Supervisor, Terminated
from composer_serverless.rendezvous import layout, recovery
from composer_serverless.rendezvous.telemetry import read_heartbeats, read_metrics
from composer_serverless.tracking.relay import Relay

logger = logging.getLogger(__name__)

HEARTBEAT_POLL_S = 1.0
# Why a live harvest stopped, as its last heartbeat tells the replicas waiting for it.
DETACHED = "the launcher detached from the run; `composer-serverless launch --resume RUN` harvests again"
# Asking local processes how they are is free (a poll of each): a run that ends is noticed within a quarter of a
# second, and the watch looks that often while only local runs are live.
LOCAL_STATUS_POLL_S = 0.25
# How often the watch relays new rounds to the run's trackers (tracking/relay.py).
RELAY_EVERY_S = 10.0

Choice = Literal["cancel", "detach"]


def cancel_on_interrupt() -> Choice:
    """The non-interactive answer to Ctrl-C: nobody can be asked, so do not leave replicas billing."""
    return "cancel"


@dataclass
class Followed:
    """One started run being followed, and what became of it.

    ``label`` prefixes the lines printed about it (``"cell 2: "`` in a sweep); ``statuses`` is each replica's
    backend state at the last poll.
    """

    supervisor: Supervisor
    config: RunConfig
    label: str = ""
    started: float = field(default_factory=time.monotonic)
    state: str = "running"
    detail: str = ""
    statuses: dict[int, str] = field(default_factory=dict)
    summary: dict[str, Any] | None = None
    next_status: float = 0.0
    backend_trouble: bool = False
    relay: Relay | None = None
    next_relay: float = 0.0

    @property
    def url(self) -> str:
        return self.supervisor.run.url


class View(Protocol):
    """How progress is drawn: a context (the live display), and an update per run and poll."""

    console: Console

    def __enter__(self) -> View: ...

    def __exit__(self, *exc: object) -> None: ...

    def show(self, run: Followed, beats: dict[int, dict[str, Any]]) -> None: ...


def follow(
    runs: list[Followed],
    view: View,
    on_interrupt: Callable[[], Choice] = cancel_on_interrupt,
    *,
    fail_fast: bool,
) -> bool:
    """Watch ``runs`` until every one has ended; False if the user detached (Ctrl-C, then "detach").

    Raises:
        RunCancelled: cancelled here (Ctrl-C, then "cancel"; SIGTERM), or, with ``fail_fast``, elsewhere.
        RunFailed: with ``fail_fast``, a replica failed for good; every run's replicas were cancelled.
    """
    harvesters = [
        LiveHarvester(run.supervisor.run, run.config, view.console) for run in runs if run.config.live_harvest
    ]
    for harvester in harvesters:
        harvester.start()
    for run in runs:
        if run.config.tracking.report_to:
            run.relay = Relay(run.supervisor.run, run.config)
            _relay(run, view.console, opening=True)
    stopped = "the run ended"
    try:
        with view:
            _watch(runs, view, fail_fast)
    except BackendError:
        # The backend refused the watcher something the user must fix (a revoked token, say); the replicas
        # do not need the launcher and go on. Cancelling would need the same API, so say how to reach them.
        stopped = DETACHED
        for run in _live(runs):
            print_detached(run.url, view.console)
        raise
    except KeyboardInterrupt:
        if on_interrupt() == "detach":
            stopped = DETACHED
            for run in _live(runs):
                print_detached(run.url, view.console)
            return False
        stopped = "the run was cancelled"
        _cancel(runs, record=True)
        raise RunCancelled("cancelled at your request") from None
    except Terminated:
        stopped = "the run was cancelled"
        _cancel(runs, record=True)
        raise RunCancelled(Terminated.message) from None
    except BaseException as e:
        stopped = f"the launcher failed ({type(e).__name__})"
        _cancel(runs, record=False)  # a failed launch must not keep its replicas billing
        raise
    finally:
        for harvester in harvesters:  # a detached launcher harvests no more: it holds the teachers' keys
            harvester.stop(stopped)
        for run in runs:  # what is ready reaches the trackers; the rest waits in the store for `status`
            _relay(run, view.console, final=True)
    return True


def write_reports(runs: list[Followed]) -> None:
    """Write the report of every run that succeeded (``summary.json`` and the plots, in its store)."""
    for run in runs:
        if run.state == "succeeded":
            earlier = run.supervisor.record.earlier_wall_s
            run.summary = write_report(
                run.supervisor.run, run.config, earlier + time.monotonic() - run.started
            )


def print_report(run: Followed, console: Console) -> None:
    summary = run.summary
    assert summary is not None
    decoupled = run.config.diloco.mode == "decoupled"
    done, same = (
        ("versions merged for", "learners held the same bytes of every version they adopted")
        if decoupled
        else ("rounds committed on", "replicas bit-identical after every sync")
    )
    who = "learners" if decoupled else "replicas"
    console.print(
        f"\n[bold]done[/]: {summary['rounds_committed']}/{summary['rounds']} {done} "
        f"{summary['replicas']} {who} in {summary['wall_s']:.0f}s"
    )
    for line in outcome(summary):
        console.print(line, highlight=False)
    console.print(
        f"{same}: {summary['replicas_bit_identical']}; "
        f"moved {summary['bytes_uploaded'] / 1e6:.1f} MB up, {summary['bytes_downloaded'] / 1e6:.1f} MB down; "
        f"checkpoints wrote {summary['checkpoint_bytes_uploaded'] / 1e6:.1f} MB"
    )
    line = speed(summary)
    if line is not None:
        console.print(line, highlight=False)
    store = run.supervisor.run
    for what, key in report_files(summary):
        console.print(f"  {what:12s} {store.url_of(key)}", highlight=False)


def report_files(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """What the report wrote, as (what, key in the run)."""
    plots = [("reward plot", layout.REWARD_PLOT)] if summary["final_eval_reward"] is not None else []
    return [("summary", layout.SUMMARY), ("plot", layout.LOSS_PLOT), *plots, ("final model", layout.FINAL)]


def print_detached(url: str, console: Console) -> None:
    console.print(
        f"\ndetached: the replicas keep running.\n"
        f"  composer-serverless status {url}\n"
        f"  composer-serverless logs {url} --rank 0 --follow\n"
        f"  composer-serverless cancel {url}",
        highlight=False,
    )


def status_poll_s(config: RunConfig) -> float:
    return getattr(config.executor, "status_poll_s", LOCAL_STATUS_POLL_S)


def _live(runs: list[Followed]) -> list[Followed]:
    return [run for run in runs if run.state == "running"]


def _watch(runs: list[Followed], view: View, fail_fast: bool) -> None:
    while True:
        for run in _live(runs):
            _poll(run, view.console, fail_fast)
            view.show(run, read_heartbeats(run.supervisor.run))
            _relay(run, view.console)
        live = _live(runs)
        if not live:
            return
        time.sleep(min([HEARTBEAT_POLL_S, *(status_poll_s(run.config) for run in live)]))


def _relay(run: Followed, console: Console, *, final: bool = False, opening: bool = False) -> None:
    """Relay the run's new rounds to its trackers, every ``RELAY_EVERY_S``; ``opening``: open the tracker
    runs, before the watch starts; ``final``: now, as the watch ends, closing them. A tracker that fails is
    said once and relayed to no more by this watch: the replicas do not need it, and the rounds this relay had
    not claimed wait in the store for the next relay (``status``); the round it failed in stays claimed, and
    is not logged to that tracker again (``tracking/relay.py``: never twice)."""
    relay = run.relay
    if relay is None or not (final or opening) and time.monotonic() < run.next_relay:
        return
    run.next_relay = time.monotonic() + RELAY_EVERY_S
    try:
        if opening:
            relay.open()
            return
        relay.catch_up(ended=run.state == "succeeded")
        if final:
            run.relay = None
            relay.close()
    except Exception as e:  # a tracker's client failing must never end the watch (or cancel the replicas)
        run.relay = None
        try:
            relay.close()
        except Exception:
            logger.debug("closing the trackers after a failure failed too", exc_info=True)
        console.print(
            f"[yellow]{escape(run.label)}could not log to the trackers ({type(e).__name__}: "
            f"{escape(str(e).splitlines()[0] if str(e) else '')}); the metrics stay in the store, and "
            f"`composer-serverless status {escape(run.url)}` logs them later[/]",
            highlight=False,
        )


def _poll(run: Followed, console: Console, fail_fast: bool) -> None:
    """Ask the backend for the run's replicas, if it is time to; record and print what changed."""
    supervisor = run.supervisor
    if supervisor.held_interrupt is not None:  # a Ctrl-C or SIGTERM held while its replicas were created
        interrupt, supervisor.held_interrupt = supervisor.held_interrupt, None
        raise interrupt
    if time.monotonic() < run.next_status:
        return
    run.next_status = time.monotonic() + status_poll_s(run.config)
    try:
        poll = supervisor.poll()
    except BackendError as e:
        if e.exit_code != 1:
            raise
        if not run.backend_trouble:  # said once per spell of trouble; the next poll tries again
            console.print(
                f"[yellow]{escape(run.label)}cannot ask the backend about the replicas for now; still "
                f"watching (the replicas do not need it):[/] {escape(str(e).splitlines()[0])}",
                highlight=False,
            )
        run.backend_trouble = True
        return
    except RunFailed as e:
        if fail_fast:
            raise
        supervisor.executor.cancel_run(supervisor.record)
        run.state, run.detail = "failed", str(e)
        console.print(f"[red]{escape(run.label)}failed:[/] {escape(str(e))}", highlight=False)
        return
    except RunCancelled as e:
        if fail_fast:
            raise
        run.state, run.detail = "cancelled", str(e)
        return
    for event in poll.events:
        console.print(f"[yellow]{escape(run.label + event)}[/]", highlight=False)
    run.statuses = {
        s.rank: s.state if s.state != "pending" else f"pending: {s.detail}" for s in poll.statuses
    }
    run.backend_trouble = False
    if poll.finished:
        run.state = "succeeded"


def _cancel(runs: list[Followed], *, record: bool) -> None:
    """Cancel the replicas of every run still going; ``record`` marks the runs cancelled in the store first
    (so no other watcher takes the dying replicas for failures)."""
    for run in _live(runs):
        if record:
            run.supervisor.cancel()
        else:
            run.supervisor.executor.cancel_run(run.supervisor.record)
        run.state = "cancelled"


def _steps_done(beat: dict[str, Any], sync_every: int) -> int:
    return max(0, beat.get("round", 1) - 1) * sync_every + beat.get("step", 0)


def role(config: RunConfig, rank: int) -> str:
    """What rank ``rank`` of the run is, as the watch and the report name it: a lock-step replica, or in
    decoupled mode a learner or the syncer (one of its shards)."""
    dl = config.diloco
    if dl.mode != "decoupled":
        return f"replica {rank}"
    if rank in dl.syncer_ranks:
        return "syncer" if len(dl.syncer_ranks) == 1 else f"syncer shard {rank - dl.replicas}"
    return f"learner {rank}"


class ReplicaView:
    """One run: a bar per replica (round, its latest reward for a composer run or loss, trained tokens per
    second, state, time left) and a line per evaluated round. In decoupled mode a bar per learner (its inner
    steps, the version it holds) and one for the syncer (the versions it merged), each named so."""

    def __init__(self, run: Followed, console: Console) -> None:
        dl = run.config.diloco
        self.console = console
        self._unit = "version" if dl.mode == "decoupled" else "round"
        self._syncers = set(dl.syncer_ranks)
        self._progress = Progress(
            TextColumn("{task.fields[who]}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn(
                f"{self._unit} {{task.fields[round]}}/{{task.fields[rounds]}}  {{task.fields[figure]}}  "
                "{task.fields[speed]}  {task.fields[state]}"
            ),
            TimeRemainingColumn(),
            console=console,
        )
        self._figure = progress_figure(run.config)
        self._tasks = {
            h.rank: self._progress.add_task(
                "",
                # a learner's or replica's inner steps; the syncer's merges
                total=dl.rounds if h.rank in self._syncers else dl.rounds * dl.sync_every,
                who=role(run.config, h.rank),
                round=0,
                rounds=dl.rounds,
                figure="" if h.rank in self._syncers else f"{self._figure} -",
                speed="",
                state="pending",
            )
            for h in run.supervisor.handles
        }
        self._started: set[int] = set()
        self._reported: set[int] = set()
        self._rollbacks = 0

    def __enter__(self) -> ReplicaView:
        self._progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.__exit__(*exc)  # type: ignore[arg-type]

    def show(self, run: Followed, beats: dict[int, dict[str, Any]]) -> None:
        sync_every = run.config.diloco.sync_every
        for rank, task in self._tasks.items():
            beat, backend = beats.get(rank, {}), run.statuses.get(rank, "pending")
            fields: dict[str, Any] = {
                "state": beat.get("state", backend) if backend == "running" else backend
            }
            if beat:
                merged = rank in self._syncers  # its beat's round: the newest version it merged
                done = beat.get("round", 0) if merged else _steps_done(beat, sync_every)
                if rank not in self._started:  # the steps done before this watch (a resume) set no pace
                    self._started.add(rank)
                    self._progress.reset(task, completed=done)
                fields.update(completed=done, round=beat.get("round", 0))
            # Beats without one (starting, done) keep the last figure on screen.
            if self._figure in beat:
                fields["figure"] = f"{self._figure} {beat[self._figure]:.3f}"
            if "tokens_per_s" in beat:
                fields["speed"] = f"{_si(beat['tokens_per_s'])} tok/s"
            self._progress.update(task, **fields)
        self._print_new_rounds(run)

    def _print_new_rounds(self, run: Followed) -> None:
        for back in recovery.rollbacks(run.supervisor.run)[self._rollbacks :]:
            self._rollbacks += 1
            self._reported = {k for k in self._reported if k <= back.to}  # redone rounds are evaluated again
            redone = f"; rounds {back.to + 1}-{back.waited_for - 1} are redone" if back.redone else ""
            self.console.print(
                f"[yellow]every replica was lost while round {back.waited_for} was in progress: the replicas "
                f"rolled the run back to round {back.to}{redone}[/]",
                highlight=False,
            )
        # The evaluator of a round is its lowest-rank participant, so any replica's metrics may carry it.
        metrics = read_metrics(run.supervisor.run)
        rows = sorted((r for rank_rows in metrics.values() for r in rank_rows), key=lambda r: r["round"])
        for row in rows:
            if row["round"] in self._reported or "eval" not in row:
                continue
            self._reported.add(row["round"])
            rounds = run.config.diloco.rounds
            label = "initial model" if row["round"] == 0 else f"{self._unit} {row['round']}/{rounds}"
            self.console.print(f"  {label}: {eval_headline(row['eval'])}", highlight=False)


def _si(value: float) -> str:
    """1234.5 -> '1.2k': a rate that stays readable at any size."""
    for factor, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= factor:
            return f"{value / factor:.1f}{suffix}"
    return f"{value:.0f}"


class RunView:
    """Several runs (a sweep): a bar per run, its inner steps over all its replicas, and its state."""

    def __init__(self, runs: list[Followed], console: Console) -> None:
        self.console = console
        self._progress = Progress(
            TextColumn("{task.fields[label]}"),
            BarColumn(),
            TaskProgressColumn(),
            TextColumn("{task.fields[state]}"),
            console=console,
        )
        self._tasks = {}
        for run in runs:
            dl = run.config.diloco
            total = dl.replicas * dl.rounds * dl.sync_every
            label = run.label.rstrip(": ")
            self._tasks[id(run)] = self._progress.add_task("", total=total, label=label, state=run.state)
        self._runs = runs

    def __enter__(self) -> RunView:
        self._progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for run in self._runs:  # the final states, also of runs that ended since their last update
            self._progress.update(self._tasks[id(run)], state=run.state)
        self._progress.__exit__(*exc)  # type: ignore[arg-type]

    def show(self, run: Followed, beats: dict[int, dict[str, Any]]) -> None:
        sync_every = run.config.diloco.sync_every
        done = sum(_steps_done(beat, sync_every) for beat in beats.values())
        self._progress.update(self._tasks[id(run)], completed=done, state=run.state)
