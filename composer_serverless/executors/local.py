"""``LocalProcessExecutor``: every replica is a subprocess on this machine, logging to its own file.

The debugging backend: the same worker command the cloud backends run, so a run that works here differs on
Modal or HF Jobs only in where the processes live. Each replica is the leader of its own session and process
group, so a terminal's Ctrl-C reaches only the launcher (which then asks whether to cancel or detach) and
cancelling ends the replica and whatever it started, and nothing else.

Handles carry the process's identity (pid, process group, creation time and the machine's boot time as
psutil reads them on Linux and macOS alike, host), so a later ``status`` or ``cancel`` from another process
signals a pid only while it still belongs to the replica that was started: a recycled pid is never
signalled. When the process is gone and was not ours to reap, its
outcome comes from the replica's final heartbeat in the store. A process started but not yet recorded (the
launcher killed in between) is found by its command line, which names the run and the rank.

For the chaos benchmark and the suite only (no config can set it): with ``COMPOSER_SERVERLESS_LOCAL_UNSCHEDULED``
naming a directory, a file there named after a rank asks that the next launch of that rank get no hardware,
as a cloud backend's job past its scheduling deadline: the attempt is recorded, reads ``unscheduled``, and no
process is started. The launch consumes the file, so one file denies one launch. Cancelling such an attempt
ends it as a cloud backend's cancel ends a job still waiting for hardware: it reads ``cancelled`` from then on,
in any process that shares the directory (a ``--resume`` after the launcher died waits for exactly that).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import psutil

from composer_serverless.accelerator import ACCELERATOR_ENV
from composer_serverless.config import ConfigError, RunConfig
from composer_serverless.executors import shipment
from composer_serverless.executors.base import (
    WORKER_MODULE,
    CostEstimate,
    Journal,
    LaunchPlan,
    LaunchRecord,
    ReplicaHandle,
    ReplicaSpec,
    ReplicaStatus,
    syncer_resources,
    worker_argv,
)
from composer_serverless.executors.environment import REPLICA_ENV, store_protocol, teacher_key_names
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import read_heartbeats

CANCEL_GRACE_S = 5.0
# The directory of requests that a rank's next launch get no hardware (see the module's docstring).
UNSCHEDULED_ENV = "COMPOSER_SERVERLESS_LOCAL_UNSCHEDULED"
_UNSCHEDULED = "unscheduled"  # the meta key of an attempt denied so, with why


class LocalProcessExecutor:
    name = "local"

    def __init__(self, run: ObjectStore, log_dir: Path) -> None:
        self._run = run
        self._log_dir = log_dir.absolute()
        self.run_secrets: dict[str, str] = {}
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._cancelled: set[int] = set()

    def plan(self, config: RunConfig, run_url: str) -> LaunchPlan:
        ex = config.executor
        replicas = config.diloco.replicas
        if store_protocol(config.store) == "memory":
            raise ConfigError(
                f"store {config.store!r} lives in one process's memory; replica subprocesses cannot see it\n"
                "  fix: --set store=runs (a directory) or an s3:// URL"
            )
        if replicas > ex.max_replicas:
            raise ConfigError(
                f"diloco.replicas ({replicas}) exceeds executor.max_replicas ({ex.max_replicas}) here\n"
                f"  fix: fewer replicas, or --set executor.max_replicas={replicas} if this machine takes them"
            )
        ranks = config.ranks_per_replica
        threads = ex.threads_per_replica or max(1, (os.cpu_count() or 1) // replicas)
        # One BLAS/OpenMP pool per rank, sized so replicas and their ranks share the cores instead of
        # oversubscribing them.
        per_rank = max(1, threads // ranks)
        env = {**REPLICA_ENV, "OMP_NUM_THREADS": str(per_rank), "MKL_NUM_THREADS": str(per_rank)}
        devices = gpu_assignment(visible_gpus(), replicas, ranks)
        specs = tuple(
            ReplicaSpec(
                rank,
                worker_argv(run_url, rank, sys.executable),
                # Pinned to GPUs of its own, which it must then find (else it stops and says why)
                env
                if devices is None
                else {**env, "CUDA_VISIBLE_DEVICES": devices[rank], ACCELERATOR_ENV: "cuda"},
            )
            for rank in range(replicas)
        )
        # The syncer's shards, on the CPU: they merge in host memory
        cpu = env if devices is None else {**env, "CUDA_VISIBLE_DEVICES": ""}
        shards = config.diloco.syncer_ranks
        specs += tuple(ReplicaSpec(rank, worker_argv(run_url, rank, sys.executable), cpu) for rank in shards)
        free = CostEstimate(0.0, "local processes: no cloud bill", 0, 0.0, 0.0, 0.0, 0.0)
        syncer = syncer_resources(config, hardware="a local CPU process")
        return LaunchPlan(
            executor=self.name,
            run_id=config.run_id or "",
            run_url=run_url,
            replicas=specs,
            cost=free,
            syncer_cost=None
            if syncer is None
            else dataclasses.replace(free, of="syncer", shards=len(shards)),
            resources={
                "syncer": syncer,
                "threads_per_replica": threads,
                "threads_per_rank": per_rank,
                "devices": "cpu" if devices is None else {str(r): d for r, d in enumerate(devices)},
                "log_dir": str(self._log_dir),
                "secrets": "inherited environment",
                "shipped": shipment.plan(config, cloud=False).describe(shipment.IN_PLACE),
                # The teachers' keys stay with the launcher, which harvests: replicas never need them.
                "withheld_env": teacher_key_names(config),
            },
            launcher_restarts=ex.max_restarts,
            ranks_per_replica=ranks,
        )

    def preflight(self, plan: LaunchPlan) -> list[str]:
        """Replicas inherit this environment, credentials included: what it lacks is the packages the run's
        code needs."""
        return [
            f"requirement {r!r} is not installed in this environment, where local replicas run\n"
            f"  fix: pip install {shlex.quote(r)}"
            for r in shipment.missing_requirements(
                tuple(plan.resources.get("shipped", {}).get("requirements", ()))
            )
        ]

    def check_access(self, plan: LaunchPlan) -> None:
        return None  # no API between this machine and its own processes

    def launch(self, plan: LaunchPlan, journal: Journal) -> list[ReplicaHandle]:
        self._log_dir.mkdir(parents=True, exist_ok=True)
        withheld = set(plan.resources.get("withheld_env", ()))
        inherited = {name: value for name, value in os.environ.items() if name not in withheld}
        handles = []
        for spec in plan.replicas:
            log = self._log_dir / f"rank-{spec.rank}.log"
            pending = journal.launching(spec.rank, {"host": socket.gethostname(), "boot_time": _boot_time()})
            if _unscheduled_requested(spec.rank):
                denied = dataclasses.replace(
                    pending,
                    backend_id=f"unscheduled-{spec.rank}-{pending.attempt}",
                    meta={**pending.meta, _UNSCHEDULED: f"no hardware, as {UNSCHEDULED_ENV} asked"},
                )
                journal.launched(denied)
                handles.append(denied)
                continue
            with open(log, "ab") as out:
                proc = subprocess.Popen(
                    spec.command,
                    # The run key reaches the replica in its environment, never its command line.
                    env={**inherited, **spec.env, **self.run_secrets},
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            self._procs[proc.pid] = proc
            handle = dataclasses.replace(
                pending, backend_id=str(proc.pid), log=str(log), meta=_identity_meta(proc.pid)
            )
            journal.launched(handle)
            handles.append(handle)
        return handles

    def status(self, handles: list[ReplicaHandle]) -> list[ReplicaStatus]:
        beats = None
        statuses = []
        for handle in handles:
            if _UNSCHEDULED in handle.meta:
                marker = _denied_marker(handle)
                state = "cancelled" if marker is not None and marker.exists() else "unscheduled"
                statuses.append(ReplicaStatus(handle.rank, state, None, handle.meta[_UNSCHEDULED]))
                continue
            if not handle.created:
                statuses.append(self._unrecorded_status(handle))
                continue
            status = self._own_status(handle) or self._foreign_status(handle)
            if status is None:
                beats = read_heartbeats(self._run) if beats is None else beats
                status = _status_from_heartbeat(handle, beats.get(handle.rank))
            statuses.append(status)
        return statuses

    def _own_status(self, handle: ReplicaHandle) -> ReplicaStatus | None:
        proc = self._procs.get(int(handle.backend_id))
        if proc is None or not _same_process(handle):
            return None
        code = proc.poll()
        if code is None:
            return ReplicaStatus(handle.rank, "running")
        if code == 0:
            return ReplicaStatus(handle.rank, "succeeded", 0)
        if proc.pid in self._cancelled:
            return ReplicaStatus(handle.rank, "cancelled", code, "cancelled")
        detail = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        return ReplicaStatus(handle.rank, "failed", code, detail)

    def _foreign_status(self, handle: ReplicaHandle) -> ReplicaStatus | None:
        """A replica another process started: running while its identity holds, else None (see beats)."""
        return ReplicaStatus(handle.rank, "running") if _verified_alive(handle, self._run) else None

    def _unrecorded_status(self, handle: ReplicaHandle) -> ReplicaStatus:
        """An attempt recorded as being started but never with its pid: its process, if it runs, is found by
        its command line."""
        found = _worker_processes(self._run, handle.rank)
        if found:
            return ReplicaStatus(handle.rank, "running", None, f"pid {found[0].pid}, never recorded")
        return ReplicaStatus(
            handle.rank, "failed", None, "its launch was interrupted before a process started"
        )

    def logs(self, handle: ReplicaHandle, follow: bool = False, tail: int | None = None) -> Iterator[str]:
        # launch.json is data in the store: a log path outside this run's log directory is not printed.
        if handle.log is not None and not Path(handle.log).resolve().is_relative_to(self._log_dir.resolve()):
            raise FileNotFoundError(
                f"launch.json names {handle.log} as the log of replica {handle.rank}, outside this run's logs "
                f"({self._log_dir}); it was not written by this project and is not read"
            )
        if handle.log is None or not Path(handle.log).exists():
            raise FileNotFoundError(
                f"the log of replica {handle.rank} is not on this machine ({handle.log}, written on "
                f"{handle.meta.get('host', 'another host')})"
            )
        with open(handle.log, errors="replace") as f:
            if tail is not None:
                yield from (line.rstrip("\n") for line in collections.deque(f, maxlen=tail))
                return
            while True:
                line = f.readline()
                if line:
                    yield line.rstrip("\n")
                elif follow and self.status([handle])[0].state == "running":
                    time.sleep(0.2)
                else:
                    return

    def cancel(self, handles: list[ReplicaHandle], grace_s: float = CANCEL_GRACE_S) -> None:
        """SIGTERM each live replica's process group, then SIGKILL what is left after ``grace_s``.

        A process is signalled only after its identity (start time, group) is checked against the handle; an
        attempt recorded without its pid is found by its command line (this run's worker, its rank).
        """
        _cancel_denied(handles)
        created = [h for h in handles if h.created and _UNSCHEDULED not in h.meta]
        ranks = {h.rank for h in handles if not h.created}
        self._end([h for h in created if self._alive(h)], _worker_processes(self._run, ranks=ranks), grace_s)

    def cancel_run(self, record: LaunchRecord, grace_s: float = CANCEL_GRACE_S) -> None:
        """Every attempt the record names, and any other process running this run's worker here."""
        _cancel_denied(record.handles)
        created = [h for h in record.handles if h.created and _UNSCHEDULED not in h.meta and self._alive(h)]
        named = {int(h.backend_id) for h in created}
        strays = [p for p in _worker_processes(self._run) if p.pid not in named]
        self._end(created, strays, grace_s)

    def _end(self, live: list[ReplicaHandle], strays: list[psutil.Process], grace_s: float) -> None:
        """SIGTERM the groups of ``live`` and of ``strays`` (each leads its own session), SIGKILL after
        ``grace_s`` what is left, and return once every one has ended: a cancel that returns has ended them."""
        for handle in live:
            self._cancelled.add(int(handle.backend_id))
            _signal_group(handle, signal.SIGTERM)
        for process in strays:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        if not self._wait(live, strays, grace_s):
            for handle in live:
                if self._alive(handle):
                    _signal_group(handle, signal.SIGKILL)
            for process in strays:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
            self._wait(live, strays, grace_s)

    def _wait(self, live: list[ReplicaHandle], strays: list[psutil.Process], timeout_s: float) -> bool:
        """Whether all of them ended within ``timeout_s`` (our children are reaped by their Popen, so that
        their exit status stays ours to read; the others are watched through psutil)."""
        deadline = time.monotonic() + timeout_s
        while any(self._running(h) for h in live) and time.monotonic() < deadline:
            time.sleep(0.05)
        _, left = psutil.wait_procs(strays, timeout=max(0.0, deadline - time.monotonic()))
        return not left and not any(self._running(h) for h in live)

    def _running(self, handle: ReplicaHandle) -> bool:
        """Whether a replica's process that was signalled has yet to exit. Not ``_alive``: a process that is
        exiting has no command line left to verify (it reads empty) while it still holds its memory, so it
        would pass for ended too soon. Its identity was checked before it was signalled; here its pid and
        creation time suffice, until it is a zombie or gone."""
        proc = self._procs.get(int(handle.backend_id))
        if proc is not None and _same_process(handle):
            return proc.poll() is None
        return _started_process(handle) is not None

    def _alive(self, handle: ReplicaHandle) -> bool:
        """Whether the replica's own process still runs; our children are also reaped here."""
        proc = self._procs.get(int(handle.backend_id))
        if proc is not None and _same_process(handle):
            return proc.poll() is None
        return _verified_alive(handle, self._run)


def _unscheduled_requested(rank: int) -> bool:
    """Whether the benchmark or the suite asked that this launch of ``rank`` get no hardware; the request is
    consumed."""
    requests = os.environ.get(UNSCHEDULED_ENV)
    if not requests:
        return False
    try:
        (Path(requests) / str(rank)).unlink()
    except FileNotFoundError:
        return False
    return True


def _denied_marker(handle: ReplicaHandle) -> Path | None:
    """Where the cancellation of an attempt denied hardware is recorded: beside the requests that denied it."""
    requests = os.environ.get(UNSCHEDULED_ENV)
    return Path(requests) / f"cancelled-{handle.backend_id}" if requests else None


def _cancel_denied(handles: Sequence[ReplicaHandle]) -> None:
    for handle in handles:
        marker = _denied_marker(handle) if _UNSCHEDULED in handle.meta else None
        if marker is not None:
            marker.touch()


def visible_gpus() -> list[str]:
    """The GPUs local replicas may use: those ``CUDA_VISIBLE_DEVICES`` names when it is set (empty: none,
    which runs every replica on the CPU), else every GPU ``nvidia-smi`` lists. Found without importing torch,
    which the launcher does not load."""
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return [d.strip() for d in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        listed = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []  # a driver that does not answer: the replicas will not find CUDA either
    return [line.strip() for line in listed.splitlines() if line.strip()]


def gpu_assignment(gpus: list[str], replicas: int, ranks: int) -> list[str] | None:
    """Per replica, the ``CUDA_VISIBLE_DEVICES`` that pins it to GPUs of its own (its ``ranks`` ranks take
    one each); None on a machine without GPUs. One-rank replicas that outnumber the GPUs share them in turn.

    Raises:
        ConfigError: replicas of several ranks need more GPUs than the machine has.
    """
    if not gpus:
        return None
    if replicas * ranks <= len(gpus):
        return [",".join(gpus[r * ranks : (r + 1) * ranks]) for r in range(replicas)]
    if ranks == 1:
        return [gpus[r % len(gpus)] for r in range(replicas)]
    raise ConfigError(
        f"{replicas} replicas x {ranks} ranks need {replicas * ranks} GPUs; this machine has {len(gpus)} "
        f"({','.join(gpus)})\n"
        f"  fix: fewer replicas or executor.ranks_per_replica (e.g. --replicas {max(1, len(gpus) // ranks)}), "
        "or CUDA_VISIBLE_DEVICES= to run every rank on the CPU"
    )


def _status_from_heartbeat(handle: ReplicaHandle, beat: dict | None) -> ReplicaStatus:
    """The outcome of a replica whose process is gone (or on another machine), from its last heartbeat."""
    started = float(handle.meta.get("started_at", 0))
    fresh = beat is not None and beat.get("time", 0) >= started - 1.0
    if fresh and beat["state"] == "done":
        return ReplicaStatus(handle.rank, "succeeded", 0, "final heartbeat: done")
    if fresh and beat["state"] == "failed":
        return ReplicaStatus(handle.rank, "failed", 1, f"final heartbeat: {beat.get('error', 'failed')}")
    if not _on_this_machine(handle):
        state = beat["state"] if fresh else "no heartbeat yet"
        return ReplicaStatus(
            handle.rank, "running", None, f"on {handle.meta.get('host')}; last heartbeat: {state}"
        )
    return ReplicaStatus(handle.rank, "failed", None, "the process ended without a final heartbeat (killed?)")


def _identity_meta(pid: int) -> dict[str, str]:
    meta = {
        "pid": str(pid),
        "pgid": str(pid),
        "host": socket.gethostname(),
        "boot_time": _boot_time(),
        "started_at": f"{time.time():.3f}",
    }
    with contextlib.suppress(psutil.Error):
        meta["create_time"] = repr(psutil.Process(pid).create_time())
    return meta


def _boot_time() -> str:
    return f"{psutil.boot_time():.0f}"


def _on_this_machine(handle: ReplicaHandle) -> bool:
    return handle.meta.get("host") == socket.gethostname() and handle.meta.get("boot_time") == _boot_time()


def _same_process(handle: ReplicaHandle) -> bool:
    """True unless the pid is proven to belong to another process now (gone, or no creation time recorded:
    trust our Popen, which still holds the exit status)."""
    created = handle.meta.get("create_time")
    if created is None:
        return True
    try:
        return psutil.Process(int(handle.backend_id)).create_time() == float(created)
    except psutil.Error:
        return True


def _started_process(handle: ReplicaHandle) -> psutil.Process | None:
    """The process the handle's pid names if it is the one that was started (the creation time recorded) and
    has not exited: a zombie or a dead process has, only its exit status is left for its parent."""
    try:
        process = psutil.Process(int(handle.backend_id))
        if process.create_time() != float(handle.meta["create_time"]):
            return None
        return None if process.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD) else process
    except (psutil.Error, KeyError, ValueError):
        return None


def _verified_alive(handle: ReplicaHandle, run: ObjectStore) -> bool:
    """The replica's process runs on this machine, is the one that was started (same creation time), and
    runs this run's worker: launch.json is data in the store, so a handle naming another process (or the
    group of one) is never taken for a replica."""
    process = _started_process(handle) if _on_this_machine(handle) else None
    if process is None:
        return False
    try:
        command = process.cmdline()
    except psutil.Error:
        return False
    located = _argument(command, "--run")
    return WORKER_MODULE in command and located is not None and run.is_at(located)


def _worker_processes(
    run: ObjectStore, rank: int | None = None, ranks: set[int] | None = None
) -> list[psutil.Process]:
    """The processes on this machine running this run's worker (of ``rank``, or of any of ``ranks``; of any
    rank when neither is given), each the leader of its own session as the executor starts them."""
    wanted = {rank} if rank is not None else ranks
    if wanted is not None and not wanted:
        return []
    found = []
    for process in psutil.process_iter(["cmdline"]):
        command = process.info["cmdline"] or []
        located, ranked = _argument(command, "--run"), _argument(command, "--rank")
        if WORKER_MODULE not in command or located is None or not run.is_at(located):
            continue
        if wanted is not None and (ranked is None or not ranked.isdigit() or int(ranked) not in wanted):
            continue
        with contextlib.suppress(psutil.Error, ProcessLookupError):  # it may exit meanwhile: not ours then
            if os.getpgid(process.pid) == process.pid and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
    return found


def _argument(command: list[str], flag: str) -> str | None:
    return command[command.index(flag) + 1] if flag in command[:-1] else None


def _signal_group(handle: ReplicaHandle, sig: signal.Signals) -> None:
    """Signal the replica's process group: its own pid, as it leads the session it was started in (never a
    group named elsewhere in the handle)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(int(handle.backend_id), sig)
