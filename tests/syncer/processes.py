"""Helpers for tests that run a decoupled run's learners and syncer as real processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from composer_serverless.rendezvous.store import ObjectStore
from tests.rendezvous.harness import HERE, start_replica, subprocess_env, wait_all

SYNCER_SCRIPT = Path(__file__).resolve().parent / "syncer_process.py"


def start_syncer(run: ObjectStore, log: Path, die_before: int | None = None) -> subprocess.Popen[bytes]:
    """The production syncer, or with ``die_before`` its twin that SIGKILLs itself after writing the
    snapshots of version ``die_before`` and before creating its record (``syncer_process.py``)."""
    if die_before is None:
        command = [sys.executable, "-m", "composer_serverless.syncer", "--run", run.url]
    else:
        command = [sys.executable, str(SYNCER_SCRIPT), "--run", run.url, "--die-before", str(die_before)]
    with open(log, "ab") as out:
        return subprocess.Popen(command, env=subprocess_env(), stdout=out, stderr=subprocess.STDOUT, cwd=HERE)


def run_decoupled(run: ObjectStore, logs: Path, learners: int) -> list[int]:
    """Run ``learners`` learners and one syncer to the end; their exit codes, the syncer's last."""
    logs.mkdir(parents=True, exist_ok=True)
    procs = [start_replica(run, r, logs / f"rank-{r}.log") for r in range(learners)]
    # Not a .log: the syncer runs on the CPU by design, and the learners' logs are checked for the simulated
    # accelerator's line.
    procs.append(start_syncer(run, logs / "syncer.out"))
    return wait_all(procs)
