"""Local processes: a dead replica is relaunched and the run completes; one that keeps failing fails the run
with its log; detach, then status/logs/cancel from other processes; cancel never signals a recycled pid; and
after a full run no secret value is in any replica's argv, the plan, the logs, or any object in the store.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from rich.console import Console

from composer_serverless.config import validate_config
from composer_serverless.executors import base
from composer_serverless.executors.base import LaunchRecord, ReplicaHandle
from composer_serverless.executors.local import LocalProcessExecutor, _identity_meta, _worker_processes
from composer_serverless.launch import runs
from composer_serverless.launch.launcher import launch, prepare, start
from composer_serverless.launch.supervisor import RunFailed
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import ObjectStore
from tests.conftest import TINY
from tests.executors.conftest import (
    HF_TOKEN,
    REPO,
    SECRET_ACCESS_KEY,
    cli,
    cli_background,
    read_until,
    store_objects,
    write_config,
)

pytestmark = pytest.mark.slow


def _config(store: str, run_id: str, rounds: int = 2, diloco: dict | None = None, **executor):
    return validate_config(
        {
            "run_id": run_id,
            "store": store,
            "model": {"tiny": TINY.model_dump()},
            "data": {"seq_len": 32, "batch_size": 4},
            "diloco": {"replicas": 2, "sync_every": 3, "rounds": rounds, **(diloco or {})},
            "eval": {"sequences": 8},
            "executor": {"type": "local", "threads_per_replica": 1, **executor},
        }
    )


@pytest.fixture
def crash(monkeypatch, tmp_path):
    """Run replicas through the test-only crashy wrapper; ``crash(ranks, times)`` sets its orders."""
    monkeypatch.setattr(base, "WORKER_MODULE", "tests.executors.crashy_worker")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("CRASH_COUNT_DIR", str(tmp_path))

    def orders(ranks: str, times: int) -> None:
        monkeypatch.setenv("CRASH_RANKS", ranks)
        monkeypatch.setenv("CRASH_TIMES", str(times))

    return orders


class ArgvSampler(threading.Thread):
    """Records the command line of every process of run ``run_url`` alive while it runs."""

    def __init__(self, run_url: str) -> None:
        super().__init__(daemon=True)
        self.run_url = run_url
        self.seen: set[str] = set()
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            for process in psutil.process_iter(["cmdline"]):
                argv = " ".join(process.info["cmdline"] or []) + " "
                if f"--run {self.run_url} " in argv:
                    self.seen.add(argv)
            time.sleep(0.05)

    def stop(self) -> set[str]:
        self._done.set()
        self.join()
        return self.seen


def test_dead_replica_is_relaunched_run_completes_and_no_secret_anywhere(
    tmp_path, s3_store, crash, monkeypatch
):
    store, client = s3_store
    crash("1", 1)
    monkeypatch.setenv("HF_TOKEN", HF_TOKEN)
    monkeypatch.chdir(tmp_path)  # the local logs of a run in S3 go to ./.composer-serverless/<run_id>/logs
    sampler = ArgvSampler(f"{store}/relaunch")
    sampler.start()
    out = io.StringIO()
    summary = launch(
        _config(store, "relaunch", max_restarts=1), "relaunch.toml", Console(file=out, width=200)
    )
    argv_seen = sampler.stop()
    output = out.getvalue()
    assert summary is not None and summary["rounds_committed"] == 2 and summary["replicas_bit_identical"], (
        output
    )
    assert "replica 1 died (exit code 3); started it again (attempt 2 of 2)" in output

    record = LaunchRecord.from_json(
        client.get_object(Bucket="bucket", Key=f"runs/relaunch/{layout.LAUNCH_RECORD}")["Body"].read()
    )
    assert [(h.rank, h.attempt) for h in record.handles] == [(0, 1), (1, 1), (1, 2)]
    log = Path(record.current()[1].log).read_text()
    assert log.index("crashing on purpose") < log.index("round 2/2")

    assert len(argv_seen) >= 2, argv_seen  # both ranks were seen running
    texts = {f"argv {i}": argv for i, argv in enumerate(sorted(argv_seen))}
    texts["launcher output"] = output
    texts |= {f"log {p.name}": p.read_text() for p in (tmp_path / ".composer-serverless").rglob("*.log")}
    texts |= {f"object {k}": v.decode("latin-1") for k, v in store_objects(client).items()}
    assert any(k.endswith("launch.json") for k in texts) and any(k.endswith("run.json") for k in texts)
    for secret in (SECRET_ACCESS_KEY, HF_TOKEN):
        assert not [where for where, text in texts.items() if secret in text], f"{secret} leaked"


def test_replica_that_keeps_failing_fails_the_run_with_its_log(tmp_path, crash):
    crash("1", 5)
    store = tmp_path / "store"
    with pytest.raises(RunFailed) as failure:
        launch(_config(str(store), "keeps-failing", max_restarts=1), "x.toml", Console(file=io.StringIO()))
    message = str(failure.value)
    assert "replica 1 failed after 2 attempts (exit code 3); last lines of its log" in message
    assert "crashing on purpose (crash 2)" in message
    record = LaunchRecord.from_json(ObjectStore(str(store / "keeps-failing")).get(layout.LAUNCH_RECORD))
    rank0 = record.current()[0]
    assert _state(rank0.backend_id) in ("Z", "gone")  # its peer was ended


def _launch_until_training(
    tmp_path: Path, run_id: str, *, script: bool = False
) -> tuple[Path, subprocess.Popen, dict[str, str]]:
    """Start ``composer-serverless launch`` of a long 2-replica local run (or, with ``script``, a 1-replica
    run from a script calling ``launcher.launch``) in the background and return once every replica is
    training: (the store directory, the launcher process, its environment)."""
    replicas = 1 if script else 2
    store = tmp_path / "store"
    config = write_config(
        tmp_path / f"{run_id}.toml",
        f"""
        run_id = "{run_id}"
        store = "{store}"
        [diloco]
        replicas = {replicas}
        sync_every = 3
        rounds = 300
        [executor]
        threads_per_replica = 1
        """,
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "COLUMNS": "200",
    }
    if script:
        launcher = cli_background(str(config), env=env, module="tests.executors.launch_script")
    else:
        launcher = cli_background("launch", str(config), env=env)
    members = store / run_id / "members"
    while not all(_beat(members / f"{r}.json").get("state") == "training" for r in range(replicas)):
        assert launcher.poll() is None, launcher.communicate()
        time.sleep(0.3)
    return store, launcher, env


def test_detach_then_status_logs_and_cancel_from_other_processes(tmp_path):
    store, launcher, env = _launch_until_training(tmp_path, "local-detach")
    launcher.send_signal(signal.SIGINT)  # Ctrl-C reaches the launcher only: replicas have their own sessions
    out, err = launcher.communicate("d\n")
    assert launcher.returncode == 0 and "detached" in out, out + err

    run_url = str(store / "local-detach")
    pids = [
        h.backend_id
        for h in LaunchRecord.from_json(
            (store / "local-detach" / layout.LAUNCH_RECORD).read_bytes()
        ).current()
    ]
    status = cli("status", run_url, env=env)
    assert status.returncode == 0 and status.stdout.count("running") == 2, status.stdout + status.stderr
    assert all(pid in status.stdout for pid in pids)
    logs = cli("logs", run_url, "--rank", "0", env=env)
    assert logs.returncode == 0 and "[replica 0]" in logs.stdout, logs.stderr

    cancel = cli("cancel", run_url, env=env)
    assert cancel.returncode == 0, cancel.stderr
    assert all(_state(pid) in ("Z", "gone") for pid in pids)
    status = cli("status", run_url, env=env)
    assert status.stdout.count("cancelled") >= 2 and "(cancelled)" in status.stdout, status.stdout


def test_sigterm_to_the_launcher_cancels_its_replicas(tmp_path):
    store, launcher, env = _launch_until_training(tmp_path, "local-term")
    pids = [
        h.backend_id
        for h in LaunchRecord.from_json((store / "local-term" / layout.LAUNCH_RECORD).read_bytes()).current()
    ]
    assert all(_state(pid) not in ("Z", "gone") for pid in pids)

    launcher.send_signal(signal.SIGTERM)  # what `kill`, `timeout` or a stopped CI job sends
    out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 1 and "SIGTERM" in err and "cancelled" in err, out + err
    assert all(_state(pid) in ("Z", "gone") for pid in pids)  # the replicas' own sessions did not save them
    status = cli("status", str(store / "local-term"), env=env)
    assert "(cancelled)" in status.stdout, status.stdout + status.stderr


def test_sigterm_to_a_script_calling_launch_cancels_its_replicas(tmp_path):
    """The benchmarks (and a user's own script) call ``launcher.launch`` without the CLI; SIGTERM to them must
    cancel the replicas as well, not end the script and leave them training in their own sessions."""
    store, script, env = _launch_until_training(tmp_path, "script-term", script=True)
    pids = [
        h.backend_id
        for h in LaunchRecord.from_json((store / "script-term" / layout.LAUNCH_RECORD).read_bytes()).current()
    ]
    script.send_signal(signal.SIGTERM)
    out, err = script.communicate(timeout=60)
    assert script.returncode == 1 and "RunCancelled: the launcher was sent SIGTERM" in err, out + err
    assert pids and all(_state(pid) in ("Z", "gone") for pid in pids)
    # The cancellation recorded, which `status` reads (shown through the CLI by the test above).
    assert LaunchRecord.from_json((store / "script-term" / layout.LAUNCH_RECORD).read_bytes()).cancelled


def test_a_launcher_killed_with_sigkill_is_resumed_by_adopting_its_live_replicas(tmp_path):
    """kill -9 leaves the launcher no chance to clean up; its replicas (own sessions) go on. `launch --resume`
    then watches those two again instead of starting two more, and `cancel` ends them all."""
    store, launcher, env = _launch_until_training(tmp_path, "local-kill")
    run_url = str(store / "local-kill")
    record_path = store / "local-kill" / layout.LAUNCH_RECORD
    pids = sorted(h.backend_id for h in LaunchRecord.from_json(record_path.read_bytes()).current())
    launcher.kill()
    launcher.communicate()
    assert all(_state(pid) == "alive" for pid in pids)

    resumed = cli_background("launch", "--resume", run_url, env=env)
    # Printed as the watch begins: whatever the resume starts has been started by then.
    seen = read_until(resumed, "estimated cost:")
    workers = _worker_processes(ObjectStore(run_url))
    assert sorted(str(p.pid) for p in workers) == pids
    record = LaunchRecord.from_json(record_path.read_bytes())
    assert [(h.rank, h.attempt) for h in record.handles] == [(0, 1), (1, 1)]

    cancel = cli("cancel", run_url, env=env)
    assert cancel.returncode == 0, cancel.stderr
    out, err = resumed.communicate(timeout=120)
    out = seen + out
    assert resumed.returncode == 1 and "cancelled" in err, out + err
    assert "still has live replicas (0, 1): watching them again instead of starting a second set" in out
    assert all(_state(pid) in ("Z", "gone") for pid in pids) and not _worker_processes(ObjectStore(run_url))


def test_a_syncer_of_two_shards_is_two_cpu_processes_and_a_cancel_ends_every_one(tmp_path, monkeypatch):
    """``diloco.decoupled.syncer_shards = 2``: ranks 2 and 3 are the syncer's shards, each a worker process on
    the CPU (kept off the GPUs the learners are pinned to), free like the learners; started, both run beside
    the learners, and a cancel ends all four."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    store = tmp_path / "store"
    sharded = {"mode": "decoupled", "embedding_average": "all", "decoupled": {"syncer_shards": 2}}
    config = _config(str(store), "local-shards", rounds=300, diloco=sharded)
    run_url = str(store / "local-shards")
    with monkeypatch.context() as gpus:
        gpus.setenv("CUDA_VISIBLE_DEVICES", "0,1")
        plan = LocalProcessExecutor(ObjectStore(run_url), tmp_path / "logs").plan(config, run_url)
    assert [s.rank for s in plan.replicas] == [0, 1, 2, 3]
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in plan.replicas] == ["0", "1", "", ""]
    assert [s.command for s in plan.replicas[2:]] == [
        base.worker_argv(run_url, r, sys.executable) for r in (2, 3)
    ]
    assert plan.resources["syncer"] == {
        "rank": 2,
        "ranks": [2, 3],
        "shards": 2,
        "hardware": "a local CPU process",
    }
    assert plan.syncer_cost is not None and plan.syncer_cost.shards == 2
    assert plan.syncer_cost.summary() == "$0 (local processes: no cloud bill)"

    supervisor = start(prepare(config, "local.toml"), Console(file=io.StringIO()))
    members = store / "local-shards" / "members"
    # Until both shards beat as the syncer does (waiting for version 0, one "step" per version), each as itself
    pids = [h.backend_id for h in supervisor.handles]
    try:
        while not all(_syncer_waiting(members / f"{rank}.json") for rank in (2, 3)):
            assert all(s.state == "running" for s in supervisor.poll().statuses)
            time.sleep(0.3)
        assert len(pids) == 4 and all(_state(pid) not in ("Z", "gone") for pid in pids)
    finally:
        statuses = runs.cancel(run_url)
    assert [(s.rank, s.state) for s in statuses] == [(r, "cancelled") for r in range(4)]
    assert all(_state(pid) in ("Z", "gone") for pid in pids)


def test_cancel_never_signals_a_process_it_did_not_start(tmp_path):
    """launch.json is data in the store: only a process that is the one started (creation time) and runs this
    run's worker (its command line) is signalled, and only its own process group."""
    run = ObjectStore(str(tmp_path))
    # Stands in for a replica: this run's worker command line, sleeping instead of training.
    sleeper = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", *base.worker_argv(run.url, 0)[2:]],
        start_new_session=True,
    )
    unrelated = subprocess.Popen(["sleep", "60"], start_new_session=True)
    real = ReplicaHandle(0, str(sleeper.pid), None, meta=_identity_meta(sleeper.pid))
    recycled = dataclasses.replace(
        real, meta={**real.meta, "create_time": repr(float(real.meta["create_time"]) - 1.0)}
    )
    forged = ReplicaHandle(1, str(unrelated.pid), None, meta=_identity_meta(unrelated.pid))
    other_group = dataclasses.replace(real, meta={**real.meta, "pgid": str(unrelated.pid)})
    executor = LocalProcessExecutor(run, tmp_path)  # another process's view: no Popen
    executor.cancel([recycled, forged], grace_s=0.1)
    assert sleeper.poll() is None, "a pid whose start time does not match was signalled"
    assert unrelated.poll() is None, "a process that is not this run's worker was signalled"
    assert executor.status([recycled])[0].state == "failed"  # not our replica: it is gone as far as we know
    assert executor.status([forged])[0].state == "failed"
    assert executor.status([real])[0].state == "running"
    executor.cancel([other_group])  # the handle's pgid names another group: the replica's own is signalled
    assert sleeper.wait() == -signal.SIGTERM
    assert unrelated.poll() is None
    unrelated.kill()
    unrelated.wait()


def test_a_worker_that_exits_while_the_processes_are_listed_is_passed_over(tmp_path, monkeypatch):
    """A worker listed by psutil that has exited by the time its process group is asked for (os.getpgid
    raises ProcessLookupError, not a psutil error): status and cancel go on without it."""
    run = ObjectStore(str(tmp_path))
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    process = psutil.Process(exited.pid)
    exited.wait()  # gone and reaped
    process.info = {"cmdline": list(base.worker_argv(run.url, 0, sys.executable))}  # as listed before that
    monkeypatch.setattr(psutil, "process_iter", lambda attrs: iter([process]))
    unrecorded = ReplicaHandle(0, "", None, meta={"host": "here"})
    executor = LocalProcessExecutor(run, tmp_path)
    assert executor.status([unrecorded])[0].state == "failed"
    executor.cancel([unrecorded])  # nothing left to signal: returns


def test_a_log_path_outside_the_run_is_not_read(tmp_path):
    secret = tmp_path / "elsewhere" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("not a log")
    executor = LocalProcessExecutor(ObjectStore(str(tmp_path / "run")), tmp_path / "run" / "logs")
    forged = ReplicaHandle(0, "1", str(tmp_path / "run" / "logs" / ".." / ".." / "elsewhere" / "secret.txt"))
    with pytest.raises(FileNotFoundError, match="outside this run's logs"):
        list(executor.logs(forged))


def _syncer_waiting(path: Path) -> bool:
    """Whether the heartbeat at ``path`` is a syncer's wait (``Syncer._beat``: one "step" per version)."""
    beat = _beat(path)
    return beat.get("state") == "waiting" and (beat.get("step"), beat.get("steps")) == (0, 1)


def _beat(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _state(pid: str) -> str:
    try:
        return "Z" if psutil.Process(int(pid)).status() == psutil.STATUS_ZOMBIE else "alive"
    except psutil.NoSuchProcess:
        return "gone"
