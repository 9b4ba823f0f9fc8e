"""Operations on an existing run, addressed by its URL alone: status, logs, cancel.

Export is ``outputs/export.py``; opening a run by its URL is ``executors/opening.py``.

Everything needed is in the run itself: ``run.json`` (the resolved config, which names the backend),
``launch.json`` (the plan and every replica attempt's handle) and the heartbeats. So these work from any
process or machine that can read the store, after the launcher detached or died. Nothing here imports the
training stack.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from composer_serverless.config import ConfigError
from composer_serverless.executors.base import (
    ReplicaStatus,
)
from composer_serverless.executors.opening import OpenRun, open_run
from composer_serverless.launch.report import progress_figure
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.telemetry import read_heartbeats


@dataclass(frozen=True)
class ReplicaRow:
    """One line of ``status``: what the backend says, what the heartbeat says (``figure``: its latest step's
    ``report.progress_figure``, the loss or a composer run's reward)."""

    rank: int
    state: str
    attempt: int
    round: str
    step: str
    figure: str
    heartbeat_age_s: float | None
    backend_id: str
    detail: str


def status(url: str) -> tuple[OpenRun, list[ReplicaRow], bool]:
    """Each replica's state from its backend plus its last heartbeat; writes the report of a finished run
    that has none (the launcher detached from it) and then says so (True), for the caller to finish what
    the launcher would have (its push to the Hub)."""
    run = open_run(url)
    handles = run.record.current()
    statuses = _as_cancelled(run, run.executor.status(handles))
    beats = read_heartbeats(run.store)
    figure = progress_figure(run.config)
    now = time.time()
    rows = []
    for handle, st in zip(handles, statuses, strict=True):
        beat = beats.get(handle.rank, {})
        rows.append(
            ReplicaRow(
                rank=handle.rank,
                state=st.state,
                attempt=handle.attempt,
                round=f"{beat['round']}/{beat['rounds']}" if "round" in beat else "-",
                step=f"{beat['step']}/{beat['steps']}" if "step" in beat else "-",
                figure=f"{beat[figure]:.4f}" if figure in beat else "-",
                heartbeat_age_s=now - beat["time"] if "time" in beat else None,
                backend_id=handle.backend_id or "(not recorded)",
                detail=st.detail or beat.get("state", ""),
            )
        )
    reported = all(st.state == "succeeded" for st in statuses) and not run.store.exists(layout.SUMMARY)
    if reported:
        _write_detached_report(run, beats)
    return run, rows, reported


def _as_cancelled(run: OpenRun, statuses: list[ReplicaStatus]) -> list[ReplicaStatus]:
    """A cancelled run's replicas that ended badly ended because of the cancel; say so."""
    if not run.record.cancelled:
        return statuses
    return [
        dataclasses.replace(s, state="cancelled", detail=s.detail or "cancelled")
        if s.state == "failed"
        else s
        for s in statuses
    ]


def _write_detached_report(run: OpenRun, beats: dict[int, dict[str, Any]]) -> None:
    """The launcher writes the report of a run it watched to the end; for a detached run, status does."""
    from composer_serverless.launch.report import write_report

    started = run.record.created_at
    ended = max((b["time"] for b in beats.values()), default=started)
    write_report(run.store, run.config, run.record.earlier_wall_s + max(0.0, ended - started))


def logs(url: str, rank: int, follow: bool) -> Iterator[str]:
    run = open_run(url)
    handle = run.handle(rank)
    try:
        yield from run.executor.logs(handle, follow=follow)
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None


def cancel(url: str) -> list[ReplicaStatus]:
    """Record the cancellation, then end every attempt of every replica the backend holds for the run (an
    attempt the record names, and on HF Jobs every job labelled with the run); ended ones are left alone.
    Returns each replica's state afterwards."""
    run = open_run(url)
    run.executor.check_access(run.record.plan)  # a refused token must not leave a run marked cancelled
    run.record = dataclasses.replace(run.record, cancelled=True)
    run.save()
    run.executor.cancel_run(run.record)
    return _as_cancelled(run, run.executor.status(run.record.current()))
