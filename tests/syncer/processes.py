"""Helpers for tests that run a decoupled run's learners and syncer as real processes."""

from __future__ import annotations

import json
from pathlib import Path

from composer_serverless.rendezvous import decoupled as versions
from composer_serverless.rendezvous.latest import newest_version
from composer_serverless.rendezvous.store import ObjectStore
from tests.rendezvous.harness import start_replica, wait_all


def run_decoupled(run: ObjectStore, logs: Path, learners: int) -> list[int]:
    """Run ``learners`` learners and the syncer (the worker as rank ``learners``, as every executor starts
    it) to the end; their exit codes, the syncer's last."""
    logs.mkdir(parents=True, exist_ok=True)
    procs = [start_replica(run, r, logs / f"rank-{r}.log") for r in range(learners + 1)]
    return wait_all(procs)


def killed_on(key: str) -> str:
    """FaultyStore arguments (``tests/rendezvous/faults.py``) that SIGKILL the process at its first call on
    ``key``."""
    return json.dumps({"kill_on": f"{key}$"})


def merges(run: ObjectStore) -> dict[int, versions.Version]:
    """Every committed version's record."""
    return {v: versions.read_version(run, v) for v in range(newest_version(run) + 1)}
