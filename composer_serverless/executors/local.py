"""``LocalProcessExecutor``: every replica is a subprocess on this machine, logging to its own file.

The debugging backend: the same worker command the cloud backends run, so a run that works here differs on
Modal or HF Jobs only in where the processes live. Each replica gets its own process group so cancelling
ends the replica and anything it started, and nothing else.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from composer_serverless.config import RunConfig
from composer_serverless.executors.base import LaunchPlan, ReplicaHandle, ReplicaSpec, ReplicaStatus

WORKER_MODULE = "composer_serverless.replicas.worker"


class LocalProcessExecutor:
    name = "local"

    def __init__(self, log_dir: Path) -> None:
        self._log_dir = log_dir
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._cancelled: set[int] = set()

    def plan(self, config: RunConfig, run_url: str) -> LaunchPlan:
        replicas = config.diloco.replicas
        threads = config.executor.threads_per_replica or max(1, (os.cpu_count() or 1) // replicas)
        # One BLAS/OpenMP pool per replica, sized so replicas share the cores instead of oversubscribing them.
        env = {
            "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads),
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
        }
        specs = tuple(
            ReplicaSpec(rank, (sys.executable, "-m", WORKER_MODULE, "--run", run_url, "--rank", str(rank)), env)
            for rank in range(replicas)
        )
        return LaunchPlan(self.name, run_url, specs, {"threads_per_replica": threads, "log_dir": str(self._log_dir)})

    def launch(self, plan: LaunchPlan) -> list[ReplicaHandle]:
        self._log_dir.mkdir(parents=True, exist_ok=True)
        handles = []
        for spec in plan.replicas:
            log = self._log_dir / f"rank-{spec.rank}.log"
            with open(log, "ab") as out:
                proc = subprocess.Popen(
                    spec.command,
                    env={**os.environ, **spec.env},
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            self._procs[proc.pid] = proc
            handles.append(ReplicaHandle(spec.rank, str(proc.pid), str(log)))
        return handles

    def status(self, handles: list[ReplicaHandle]) -> list[ReplicaStatus]:
        return [self._status(h) for h in handles]

    def _status(self, handle: ReplicaHandle) -> ReplicaStatus:
        proc = self._procs.get(int(handle.backend_id))
        if proc is None:
            raise KeyError(f"replica {handle.rank} (pid {handle.backend_id}) was not started by this executor")
        code = proc.poll()
        if code is None:
            return ReplicaStatus(handle.rank, "running")
        if code == 0:
            return ReplicaStatus(handle.rank, "succeeded", 0)
        if proc.pid in self._cancelled:
            return ReplicaStatus(handle.rank, "cancelled", code, "cancelled")
        detail = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        return ReplicaStatus(handle.rank, "failed", code, detail)

    def logs(self, handle: ReplicaHandle, follow: bool = False) -> Iterator[str]:
        if handle.log is None:
            return
        with open(handle.log, errors="replace") as f:
            while True:
                line = f.readline()
                if line:
                    yield line.rstrip("\n")
                elif follow and self._status(handle).state == "running":
                    time.sleep(0.2)
                else:
                    return

    def cancel(self, handles: list[ReplicaHandle], grace_s: float = 5.0) -> None:
        """SIGTERM each replica's process group, then SIGKILL whatever is left after ``grace_s``."""
        live = [self._procs[int(h.backend_id)] for h in handles if int(h.backend_id) in self._procs]
        live = [p for p in live if p.poll() is None]
        for proc in live:
            self._cancelled.add(proc.pid)
            _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in live:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)
