"""Operations on an existing run, addressed by its URL alone: status, logs, cancel (export: ``exports.py``).

Everything needed is in the run itself: ``run.json`` (the resolved config, which names the backend),
``launch.json`` (the plan and every replica attempt's handle) and the heartbeats. So these work from any
process or machine that can read the store, after the launcher detached or died. Nothing here imports the
training stack.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from composer_serverless.config import ConfigError, RunConfig
from composer_serverless.executors import make_executor
from composer_serverless.executors.base import (
    LaunchRecord,
    ReplicaHandle,
    ReplicaStatus,
    ServerlessExecutor,
)
from composer_serverless.executors.environment import store_protocol
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import ObjectStore, StoreError
from composer_serverless.rendezvous.telemetry import read_heartbeats

RUN_URL_HINT = "RUN is the URL `launch` printed, e.g. s3://bucket/runs/<run_id> or ./runs/<run_id>"
STORE_HINT = "set store to a directory or an object store, e.g. --set store=s3://<bucket>/runs"
STORE_PROTOCOLS = frozenset({"file", "local", "memory", "s3", "gcs", "az", "abfs", "hf"})


def open_store(url: str, fix: str = RUN_URL_HINT) -> ObjectStore:
    """``ObjectStore(url)`` with a message a user can act on when the URL is not an object store we can open.

    Only object-store protocols are accepted: fsspec would happily open ``ftp://`` or ``http://`` (and
    connect while doing so), neither of which can hold a run. ``fix`` is the advice for where the URL came
    from (a RUN argument, or the config's ``store``).
    """
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:/(?!/)", url):
        raise ConfigError(f"{url!r} is a malformed URL: a protocol is followed by '://'\n  fix: {fix}")
    protocol = store_protocol(url)
    if protocol not in STORE_PROTOCOLS:
        raise ConfigError(
            f"{url!r} is not a store URL: {protocol}:// cannot hold a run; use a directory, file:///path, "
            f"s3://bucket/prefix, gs://bucket/prefix or hf://buckets/<ns>/<bucket>/prefix\n  fix: {fix}"
        )
    try:
        return ObjectStore(url)
    except (ValueError, ImportError) as e:
        raise ConfigError(
            f"{url!r} is not a store URL this machine can open: {e}\n"
            "  fix: use a directory, file:///path or s3://bucket/prefix "
            "(s3 needs: pip install 'composer-serverless[s3]')"
        ) from None


def absolute_store(url: str) -> str:
    """A plain relative directory made absolute, so the run URL means the same from any working directory."""
    return os.path.abspath(url) if "://" not in url and store_protocol(url) == "file" else url


@dataclass
class OpenRun:
    """A launched run: its store prefix, resolved config, launch record and the executor that started it."""

    store: ObjectStore
    config: RunConfig
    record: LaunchRecord
    executor: ServerlessExecutor

    def handle(self, rank: int) -> ReplicaHandle:
        handles = {h.rank: h for h in self.record.current()}
        if rank not in handles:
            raise ConfigError(
                f"--rank {rank}: the run has ranks 0..{len(handles) - 1}\n  fix: pick one of those"
            )
        return handles[rank]

    def save(self) -> None:
        self.store.put(layout.LAUNCH_RECORD, self.record.to_json())


def open_created(url: str) -> tuple[ObjectStore, RunConfig]:
    """The run at ``url`` and the config it was created with; ConfigError (exit 2) when there is none."""
    store = open_store(url.rstrip("/"))
    try:
        raw_config = store.get(layout.RUN_CONFIG)
    except FileNotFoundError:
        raise ConfigError(
            f"{url} is not a run: there is no {layout.RUN_CONFIG} there\n  fix: {RUN_URL_HINT}"
        ) from None
    except Exception as e:  # an unreachable store or missing credentials look alike to the user
        raise StoreError(f"cannot read the run at {url}: {type(e).__name__}: {e}") from e
    return store, RunConfig.model_validate_json(raw_config)


def open_run(url: str) -> OpenRun:
    """Everything about the launched run at ``url``; ConfigError (exit 2) when ``url`` is not one."""
    store, config = open_created(url)
    try:
        record = LaunchRecord.from_json(store.get(layout.LAUNCH_RECORD))
    except FileNotFoundError:
        raise ConfigError(
            f"the run at {url} was created but never launched (no {layout.LAUNCH_RECORD})"
        ) from None
    return OpenRun(store, config, record, make_executor(config, store))


@dataclass(frozen=True)
class ReplicaRow:
    """One line of ``status``: what the backend says, what the heartbeat says."""

    rank: int
    state: str
    attempt: int
    round: str
    step: str
    loss: str
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
                loss=f"{beat['loss']:.4f}" if "loss" in beat else "-",
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
    from composer_serverless.report import write_report

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
