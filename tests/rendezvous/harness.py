"""Helpers for tests that run real replica processes against a run in a store."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from composer_serverless.config import RunConfig, validate_config
from composer_serverless.launch.launcher import create_run
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import read_metrics

# Two fragments with overlap: between rounds the local parameters differ from the global ones (error reset
# keeps the residual in them), which makes resuming (and any fault) exercise every piece of per-replica state.
# A checkpoint every round.
REFERENCE_SETTINGS: dict[str, Any] = {
    "checkpoint_every": 1,
    "rounds": 5,
    "min_replicas": 2,
    "fragments": 2,
    "fragment_sync_delay": 1,
    # The sparse codec with error feedback kept in the local weights: the lossiest path, whose residuals and
    # local weights a resume must restore exactly (the default, "resend", runs in the kill -9, FSDP, LoRA and
    # keyed tests; the FSDP ones with the alpha merge, which error reset refuses).
    "codec": "sparse",
    "error_feedback": "reset",
}

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
REPLICA_SCRIPT = HERE / "replica_process.py"
# Generous: a replica process imports torch and transformers; on a loaded 2-core machine that alone can
# take many seconds. Nothing here depends on this being tight.
PROCESS_TIMEOUT_S = 300


def subprocess_env() -> dict[str, str]:
    """The environment replica processes run with: this checkout first on the path, one thread each."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {
        **os.environ,
        "PYTHONPATH": path,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }


@dataclass(frozen=True)
class ReferenceRun:
    """A clean run of REFERENCE_SETTINGS and the global-parameter digests its replicas reported per round."""

    run: ObjectStore
    digests: dict[int, set[str]]


def make_config(store: str, run_id: str, model_dir: Path, ranks: int = 1, **diloco: Any) -> RunConfig:
    """A small run of the tiny model; ``ranks`` per replica (FSDP inside a replica when more than one)."""
    raw = {
        "run_id": run_id,
        "store": store,
        "seed": 0,
        "model": {"path": str(model_dir)},
        "data": {"seq_len": 16, "batch_size": 2},
        "train": {"lr": 1e-2, "warmup_steps": 2, "schedule": "cosine"},
        "diloco": {"replicas": 2, "sync_every": 4, "rounds": 4, "sync_timeout_s": 120, **diloco},
        "eval": {"sequences": 2},
        "executor": {"ranks_per_replica": ranks},
    }
    return validate_config(raw)


def create(config: RunConfig) -> ObjectStore:
    run, _ = create_run(config, "test", Console(quiet=True))
    return run


def start_replica(
    run: ObjectStore, rank: int, log: Path, faults: str | None = None
) -> subprocess.Popen[bytes]:
    """The production worker, or, with ``faults`` (FaultyStore arguments as JSON), its test twin."""
    if faults:
        command = [
            sys.executable,
            str(REPLICA_SCRIPT),
            "--run",
            run.url,
            "--rank",
            str(rank),
            "--faults",
            faults,
        ]
    else:
        command = [
            sys.executable,
            "-m",
            "composer_serverless.replicas.worker",
            "--run",
            run.url,
            "--rank",
            str(rank),
        ]
    with open(log, "ab") as out:
        return subprocess.Popen(command, env=subprocess_env(), stdout=out, stderr=subprocess.STDOUT, cwd=HERE)


def wait_all(procs: list[subprocess.Popen[bytes]], timeout_s: float = PROCESS_TIMEOUT_S) -> list[int]:
    """Exit codes of ``procs``; kills (and fails) whatever is still running after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for other in procs:
                if other.poll() is None:
                    other.kill()
                    other.wait()
            raise
    return codes


def run_replicas(
    run: ObjectStore, logs: Path, replicas: int, faults: dict[int, str] | None = None
) -> list[int]:
    logs.mkdir(parents=True, exist_ok=True)
    procs = [start_replica(run, r, logs / f"rank-{r}.log", (faults or {}).get(r)) for r in range(replicas)]
    return wait_all(procs)


def rows(run: ObjectStore) -> dict[int, dict[int, dict[str, Any]]]:
    """Per rank, per round: the metrics row."""
    return {rank: {row["round"]: row for row in rank_rows} for rank, rank_rows in read_metrics(run).items()}


def digests(run: ObjectStore) -> dict[int, set[str]]:
    """Per round, the distinct global-parameter digests the replicas reported."""
    out: dict[int, set[str]] = {}
    for by_round in rows(run).values():
        for round_index, row in by_round.items():
            if "global_sha256" in row:
                out.setdefault(round_index, set()).add(row["global_sha256"])
    return out


def logs_of(logs: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(logs.glob("*.log")))


def resume_in_a_process(run: ObjectStore, *overrides: str) -> subprocess.CompletedProcess[str]:
    """``composer-serverless launch --resume`` (with ``--set`` for each of ``overrides``) in a fresh
    interpreter, as a user runs it."""
    sets = [arg for override in overrides for arg in ("--set", override)]
    return subprocess.run(
        [
            sys.executable,
            "-c",
            "from composer_serverless.cli import main; main()",
            "launch",
            "--resume",
            run.url,
            *sets,
        ],
        env={**subprocess_env(), "COLUMNS": "200"},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
