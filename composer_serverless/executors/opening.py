"""Opening a run by its URL: the store behind it, the config it was created with, its launch record and the
executor that started it.

Everyone who opens an existing run (the launch side, the outputs, the harvest) goes through here, so the
messages for a URL that is not a run, or not a store this machine can open, are the same everywhere. It sits
with the executors because an opened run carries the executor that can reach its replicas.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from composer_serverless.config import ConfigError, RunConfig
from composer_serverless.executors import make_executor
from composer_serverless.executors.base import LaunchRecord, ReplicaHandle, ServerlessExecutor
from composer_serverless.executors.environment import store_protocol
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import ObjectStore, StoreError

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
