"""The executor protocol: how a launch plan becomes N running replicas on some backend.

Plans and handles are frozen, JSON-serialisable values: a plan can be printed and tested without any
network, and handles are stored in the run so another process can watch or cancel it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from composer_serverless.config import RunConfig

ReplicaState = Literal["pending", "running", "succeeded", "failed", "cancelled"]
TERMINAL_STATES: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})


@dataclass(frozen=True)
class ReplicaSpec:
    """One replica to start: the worker command and the (non-secret) environment it runs with."""

    rank: int
    command: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class LaunchPlan:
    """Everything an executor will start for a run, decided before anything is started."""

    executor: str
    run_url: str
    replicas: tuple[ReplicaSpec, ...]
    resources: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)


@dataclass(frozen=True)
class ReplicaHandle:
    """How to find a started replica again: its backend id and where its log is."""

    rank: int
    backend_id: str
    log: str | None = None


@dataclass(frozen=True)
class ReplicaStatus:
    rank: int
    state: ReplicaState
    exit_code: int | None = None
    detail: str = ""


@runtime_checkable
class ServerlessExecutor(Protocol):
    name: str

    def plan(self, config: RunConfig, run_url: str) -> LaunchPlan: ...

    def launch(self, plan: LaunchPlan) -> list[ReplicaHandle]: ...

    def status(self, handles: list[ReplicaHandle]) -> list[ReplicaStatus]: ...

    def logs(self, handle: ReplicaHandle, follow: bool = False) -> Iterator[str]: ...

    def cancel(self, handles: list[ReplicaHandle]) -> None: ...
