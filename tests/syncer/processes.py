"""Helpers for tests that run a decoupled run's learners and syncer as real processes."""

from __future__ import annotations

import json
from pathlib import Path

from composer_serverless.rendezvous import decoupled as versions
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.latest import newest_version
from composer_serverless.rendezvous.store import ObjectStore
from tests.rendezvous.harness import start_replica, wait_all


def run_decoupled(run: ObjectStore, logs: Path, learners: int, syncers: int = 1) -> list[int]:
    """Run ``learners`` learners and the syncer (the worker as rank ``learners``, as every executor starts
    it; sharded, ``syncers`` ranks from there) to the end; their exit codes, the syncer's last."""
    logs.mkdir(parents=True, exist_ok=True)
    procs = [start_replica(run, r, logs / f"rank-{r}.log") for r in range(learners + syncers)]
    return wait_all(procs)


def killed_on(key: str) -> str:
    """FaultyStore arguments (``tests/rendezvous/faults.py``) that SIGKILL the process at its first call on
    ``key``."""
    return json.dumps({"kill_on": f"{key}$"})


def merges(run: ObjectStore) -> dict[int, versions.Version]:
    """Every committed version's record."""
    return {v: versions.read_version(run, v) for v in range(newest_version(run) + 1)}


def snapshots_and_contributions(run: ObjectStore) -> dict[str, list[str]]:
    """What the store holds besides the versions' records: the snapshots of parameters and of outer states
    (``{version:08d}-{writer}``) and every contribution's key."""
    return {
        "globals": run.list(layout.GLOBALS),
        "outer": run.list(layout.SYNCER_STATES),
        "contributions": run.list_tree(layout.CONTRIBUTIONS),
    }


def pruned_to(records: dict[int, versions.Version], keep: int) -> dict[str, list[str]]:
    """``snapshots_and_contributions`` of a finished run pruned to its ``keep`` newest versions: their own
    snapshots only (no orphan of a lost or killed merge), and the contributions the oldest kept version had
    not consumed (a rollback to it would merge them again; the newest consumed them all)."""
    kept = [f"{v:08d}-{records[v].writer}" for v in sorted(records)[-keep:]]
    oldest = records[sorted(records)[-keep]]
    newest = records[max(records)]
    return {
        "globals": kept,
        "outer": [name for name in kept if not name.startswith("00000000-")],
        "contributions": sorted(
            f"{learner}/{seq:08d}"
            for learner, mark in newest.consumed.items()
            for seq in range(oldest.consumed.get(learner, 0), mark)
        ),
    }
