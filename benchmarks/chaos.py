"""Chaos soak: many short runs of the demo model, each under a random schedule of faults, and whether each ends.

    python benchmarks/chaos.py --out bench-out/chaos                     # 30 runs
    python benchmarks/chaos.py --out bench-out/chaos-quick --runs 3 --seed 1

Each run is the demo's model and data (``deploy/configs/local-demo.toml``) on 4 local replica processes,
launched by the CLI in a process of its own (so that it can be killed), a few short rounds with a checkpoint
every other round, relayed to TensorBoard. Before it starts, one to three faults are drawn with the seed (the
first runs take each kind in turn, so every kind is exercised however few runs there are), each at a random
round:

- ``kill_one``, ``kill_some``, ``kill_all``: SIGKILL of one, two or three, or all four replica processes as
  soon as a replica trains that round; the launcher starts them again (all killed: they roll the run back by
  themselves, ``rendezvous/recovery.py``).
- ``kill_launcher``: SIGKILL of the launcher; a second later ``launch --resume RUN`` adopts the replicas that
  still run.
- ``freeze_store``: the run's store is a moto S3 server on loopback reached through a proxy process; the proxy
  is stopped (SIGSTOP) for a random share of ``diloco.store_outage_s`` and continued: every request of the
  replicas and the launcher hangs meanwhile, as through a partition.
- ``unscheduled``: one replica is killed and its restart gets no hardware (the local executor's
  ``COMPOSER_SERVERLESS_LOCAL_UNSCHEDULED``, set only here and in the suite): the launcher gives it up and the
  run goes on without it.
- ``two_relays``: while the run goes on, ``composer-serverless status RUN`` runs again and again in other
  processes, each relaying to the same trackers as the launcher.

Per run: whether it ended (exit 0 within ``--bound-s``, or a clear error), the rounds committed and redone,
the rollbacks, the longest time any replica waited (a continuous ``waiting`` heartbeat, polled every 0.2 s, or
one round's time blocked in its sync, from the metrics rows), the TensorBoard points of ``train/loss`` per
step (each step of the run exactly once: none twice, none skipped) and the processes of the run still alive
after it ended (killed then, and counted). The checks: every run ends within its bound, no wait longer than
``diloco.sync_timeout_s``, no step relayed twice or skipped, nothing left running. Writes ``results.json``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from composer_serverless.executors.base import LaunchRecord
from composer_serverless.executors.local import UNSCHEDULED_ENV
from composer_serverless.rendezvous import layout, recovery
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import read_heartbeats, read_metrics

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from link_emulator import Link, start_in_process  # noqa: E402

REPLICAS = 4
FAULTS = ("kill_one", "kill_some", "kill_all", "kill_launcher", "freeze_store", "unscheduled", "two_relays")
# The settings of every run: short rounds, a checkpoint every other round, waits short enough that a soak of
# 30 runs fits in well under an hour, yet every wait still bounded by the product's own rules.
SETTINGS = {
    "diloco.replicas": REPLICAS,
    "diloco.rounds": 8,
    "diloco.sync_every": 4,
    "diloco.checkpoint_every": 2,
    "diloco.min_replicas": 1,
    "diloco.quorum_grace_min_s": 2.0,
    "diloco.quorum_grace_max_s": 10.0,
    "diloco.sync_timeout_s": 40.0,
    "diloco.store_outage_s": 20.0,
    "data.batch_size": 4,
    "eval.sequences": 16,
    "train.warmup_steps": 4,
    "executor.max_restarts": 4,
    "tracking.report_to": ["tensorboard"],
}
POLL_S = 0.2
STATUS_EVERY_S = 1.5


@dataclass(frozen=True)
class Fault:
    """One fault of a run's schedule: what, in which round, to which ranks, for how long (a freeze)."""

    kind: str
    round: int
    ranks: tuple[int, ...] = ()
    seconds: float = 0.0


def schedule(rng: random.Random, index: int, rounds: int, outage_s: float) -> list[Fault]:
    """The faults of run ``index``: its turn's kind first (so the first runs cover every kind), then up to two
    other kinds drawn at random; each in a round of 1 .. rounds - 1 (a fault in the last round could land
    after the run ended)."""
    kinds = [FAULTS[index % len(FAULTS)]]
    others = [k for k in FAULTS if k not in kinds]
    kinds += rng.sample(others, rng.choice([0, 1, 2]))
    faults = []
    for kind in kinds:
        ranks: tuple[int, ...] = ()
        if kind in ("kill_one", "unscheduled"):
            ranks = (rng.randrange(REPLICAS),)
        elif kind == "kill_some":
            ranks = tuple(sorted(rng.sample(range(REPLICAS), rng.choice([2, 3]))))
        elif kind == "kill_all":
            ranks = tuple(range(REPLICAS))
        seconds = round(rng.uniform(0.3, 0.9) * outage_s, 1) if kind == "freeze_store" else 0.0
        faults.append(Fault(kind, rng.randrange(1, rounds), ranks, seconds))
    return sorted(faults, key=lambda f: (f.round, f.kind))


# --- the store: a directory, or moto S3 behind a proxy that can be frozen --------------------------------


@contextlib.contextmanager
def s3_behind_proxy() -> Iterator[tuple[str, dict[str, str], psutil.Process]]:
    """A moto S3 server on loopback and a proxy process in front of it: the run's store URL, the environment
    the run's processes reach it with (through the proxy), and the proxy process (to freeze). This process
    reads the store directly, so a frozen proxy never stalls the measurements."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    direct = f"http://{host}:{port}"
    proxy, endpoint = start_in_process((host, port), Link(mbps=10_000.0, latency_s=0.0))
    credentials = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {name: os.environ.get(name) for name in [*credentials, "AWS_ENDPOINT_URL_S3"]}
    os.environ.update(credentials, AWS_ENDPOINT_URL_S3=direct)
    try:
        boto3.client("s3", endpoint_url=direct).create_bucket(Bucket="chaos")
        yield "s3://chaos/runs", {**credentials, "AWS_ENDPOINT_URL_S3": endpoint}, psutil.Process(proxy.pid)
    finally:
        with contextlib.suppress(psutil.Error):
            psutil.Process(proxy.pid).resume()
        proxy.terminate()
        proxy.join(timeout=10)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        server.stop()


# --- one run ---------------------------------------------------------------------------------------------


@dataclass
class Watch:
    """What the poller saw: per rank, the longest continuous ``waiting`` heartbeat."""

    longest_waiting_s: dict[int, float] = field(default_factory=dict)
    _since: dict[int, float] = field(default_factory=dict)

    def see(self, beats: dict[int, dict[str, Any]], now: float) -> None:
        for rank, beat in beats.items():
            if beat.get("state") == "waiting":
                start = self._since.setdefault(rank, now)
                self.longest_waiting_s[rank] = max(self.longest_waiting_s.get(rank, 0.0), now - start)
            else:
                self._since.pop(rank, None)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "composer_serverless", *args]


def _overrides(settings: dict[str, Any]) -> list[str]:
    return [a for key, value in settings.items() for a in ("--set", f"{key}={json.dumps(value)}")]


def _replica_pids(run: ObjectStore, ranks: tuple[int, ...]) -> list[int]:
    """The pids of the current attempts of ``ranks`` that have a process."""
    if not run.exists(layout.LAUNCH_RECORD):
        return []
    handles = LaunchRecord.from_json(run.get(layout.LAUNCH_RECORD)).current()
    return [int(h.backend_id) for h in handles if h.rank in ranks and h.backend_id.isdigit()]


def _kill(pids: list[int]) -> list[int]:
    killed = []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    return killed


def _run_processes(run_id: str) -> list[psutil.Process]:
    """Every process on this machine whose command line names the run (its replicas, launchers, relays)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            if proc.pid != os.getpid() and any(run_id in part for part in proc.info["cmdline"] or ()):
                found.append(proc)
    return found


def relayed_steps(directory: Path, tag: str = "train/loss") -> collections.Counter[int]:
    """How many times each step of ``tag`` was written to the TensorBoard event files under ``directory``
    (every relay's files, wherever each wrote them)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    counts: collections.Counter[int] = collections.Counter()
    for path in sorted(directory.rglob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.tag == tag:
                    counts[event.step] += 1
    return counts


def run_once(
    index: int, faults: list[Fault], config: str, out: Path, bound_s: float, seed: int
) -> dict[str, Any]:
    run_id = f"chaos-s{seed}-{index:02d}"
    tracking_dir = out / "tracking" / run_id
    unscheduled_dir = out / "unscheduled" / run_id
    unscheduled_dir.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    settings = {**SETTINGS, "run_id": run_id, "seed": seed, "tracking.dir": str(tracking_dir)}
    rounds, sync_timeout_s = settings["diloco.rounds"], settings["diloco.sync_timeout_s"]
    events: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        if any(f.kind == "freeze_store" for f in faults):
            store, store_env, proxy = stack.enter_context(s3_behind_proxy())
        else:
            store, store_env, proxy = f"file://{(out / 'runs').absolute()}", {}, None
        settings["store"] = store
        env = {**os.environ, **store_env, UNSCHEDULED_ENV: str(unscheduled_dir), "COLUMNS": "160"}
        run = ObjectStore(store).child(run_id)
        started = time.monotonic()

        def start(args: list[str], name: str) -> subprocess.Popen[bytes]:
            log = stack.enter_context(open(logs / f"{run_id}-{name}.log", "wb"))
            return subprocess.Popen(
                args, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )

        launcher = start(_cli("launch", config, *_overrides(settings)), "launch")
        pending = list(faults)
        watch = Watch()
        relays: list[subprocess.Popen[bytes]] = []
        relaying = any(f.kind == "two_relays" for f in faults)
        next_status = 0.0
        ended = None
        while ended is None:
            now = time.monotonic()
            if now - started > bound_s:
                launcher.send_signal(signal.SIGTERM)  # the CLI cancels its replicas on SIGTERM
                with contextlib.suppress(subprocess.TimeoutExpired):
                    launcher.wait(timeout=60)
                events.append({"at_s": round(now - started, 1), "what": "bound reached: launcher terminated"})
                ended = False
                break
            try:
                beats = read_heartbeats(run) if run.exists(layout.MEMBERS) else {}
            except FileNotFoundError:
                beats = {}
            watch.see(beats, now)
            training = max(
                (b.get("round", 0) for b in beats.values() if b.get("state") == "training"), default=0
            )
            for fault in [f for f in pending if training >= f.round]:
                pending.remove(fault)
                events.append({"at_s": round(now - started, 1), **asdict(fault)})
                if fault.kind == "kill_launcher":
                    launcher.kill()
                    launcher.wait()
                    time.sleep(1.0)
                    launcher = start(_cli("launch", "--resume", run.url), "resume")
                elif fault.kind == "freeze_store" and proxy is not None:
                    proxy.suspend()
                    time.sleep(fault.seconds)
                    proxy.resume()
                elif fault.kind in ("kill_one", "kill_some", "kill_all", "unscheduled"):
                    if fault.kind == "unscheduled":
                        (unscheduled_dir / str(fault.ranks[0])).touch()
                    events[-1]["killed"] = _kill(_replica_pids(run, fault.ranks))
            if relaying and now >= next_status:
                relays.append(start(_cli("status", run.url), f"status-{len(relays)}"))
                next_status = now + STATUS_EVERY_S
            if launcher.poll() is not None:
                ended = True
            time.sleep(POLL_S)
        wall_s = time.monotonic() - started
        for relay in relays:
            with contextlib.suppress(subprocess.TimeoutExpired):
                relay.wait(timeout=60)
        # One more relay once everything ended: whatever a killed relay left is delivered now, once.
        final_status = subprocess.run(_cli("status", run.url), env=env, capture_output=True, timeout=120)
        time.sleep(2.0)
        left = _run_processes(run_id)
        for proc in left:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        tail = (
            logs / f"{run_id}-{'resume' if any(f.kind == 'kill_launcher' for f in faults) else 'launch'}.log"
        )
        summary = json.loads(run.get(layout.SUMMARY)) if run.exists(layout.SUMMARY) else {}
        rows = [r for rank_rows in read_metrics(run).values() for r in rank_rows]
        blocked = max((float(r.get("blocked_s", 0.0)) for r in rows), default=0.0)
        counts = relayed_steps(tracking_dir)
        expected = set(range(1, rounds * settings["diloco.sync_every"] + 1))
        result = {
            "run_id": run_id,
            "store": "s3" if proxy is not None else "directory",
            "faults": [asdict(f) for f in faults],
            "faults_not_applied": [asdict(f) for f in pending],
            "events": events,
            "exit_code": launcher.returncode,
            "ended": bool(ended) and launcher.returncode == 0,
            "last_lines": tail.read_text(errors="replace").strip().splitlines()[-3:] if tail.exists() else [],
            "final_status_exit": final_status.returncode,
            "wall_s": round(wall_s, 1),
            "rounds_committed": summary.get("rounds_committed"),
            "rounds_redone": summary.get("rounds_redone"),
            "rollbacks": [{"waited_for": r.waited_for, "to": r.to} for r in recovery.rollbacks(run)],
            "longest_waiting_s": round(max(watch.longest_waiting_s.values(), default=0.0), 1),
            "longest_blocked_s": round(blocked, 1),
            "longest_wait_s": round(max([blocked, *watch.longest_waiting_s.values()]), 1),
            "sync_timeout_s": sync_timeout_s,
            "steps_relayed_twice": sorted(s for s, n in counts.items() if n > 1),
            "steps_skipped": sorted(expected - set(counts)),
            "processes_left": [p.pid for p in left],
        }
    return result


def checks(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    def where(pred: Any) -> list[str]:
        return [r["run_id"] for r in results if pred(r)]

    exercised = collections.Counter(
        f["kind"] for r in results for f in r["faults"] if f not in r["faults_not_applied"]
    )
    return {
        "every_run_ended_within_its_bound": {
            "failed": where(lambda r: not r["ended"]),
            "met": all(r["ended"] for r in results),
        },
        "no_wait_longer_than_sync_timeout_s": {
            "failed": where(lambda r: r["longest_wait_s"] > r["sync_timeout_s"]),
            "met": all(r["longest_wait_s"] <= r["sync_timeout_s"] for r in results),
        },
        "no_step_relayed_twice_or_skipped": {
            "failed": where(lambda r: r["steps_relayed_twice"] or r["steps_skipped"]),
            "met": not any(r["steps_relayed_twice"] or r["steps_skipped"] for r in results),
        },
        "nothing_left_running": {
            "failed": where(lambda r: r["processes_left"]),
            "met": not any(r["processes_left"] for r in results),
        },
        "every_fault_kind_exercised": {"value": dict(exercised), "met": set(exercised) == set(FAULTS)},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, required=True, help="directory for results.json, the runs and logs"
    )
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bound-s", type=float, default=420.0, help="a run that has not ended by then fails")
    parser.add_argument("--config", default=str(REPO / "deploy" / "configs" / "local-demo.toml"))
    args = parser.parse_args(argv)
    if (args.out / "runs").is_dir() and any((args.out / "runs").iterdir()):
        parser.error(
            f"--out {args.out} already holds runs from an earlier invocation; choose a new directory"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    rounds, outage_s = SETTINGS["diloco.rounds"], SETTINGS["diloco.store_outage_s"]
    started = time.monotonic()
    results = []
    for index in range(args.runs):
        faults = schedule(rng, index, rounds, outage_s)
        row = run_once(index, faults, args.config, args.out, args.bound_s, args.seed)
        results.append(row)
        print(
            f"[{time.monotonic() - started:6.0f}s] {row['run_id']} {','.join(f['kind'] for f in row['faults']):45s} "
            f"exit {row['exit_code']} rounds {row['rounds_committed']} redone {row['rounds_redone']} "
            f"wait {row['longest_wait_s']}s twice {len(row['steps_relayed_twice'])} skipped "
            f"{len(row['steps_skipped'])} left {len(row['processes_left'])} ({row['wall_s']:.0f}s)",
            flush=True,
        )
    command = " ".join(["python", "benchmarks/chaos.py", *(sys.argv[1:] if argv is None else argv)])
    result = {
        "command": command,
        "settings": SETTINGS,
        "checks": checks(results),
        "runs": results,
        "wall_s": round(time.monotonic() - started, 1),
    }
    (args.out / "results.json").write_text(json.dumps(result, indent=2))
    for name, check in result["checks"].items():
        print(f"{'met' if check['met'] else 'NOT met':8s} {name}: {check.get('failed', check.get('value'))}")
    return 0 if all(c["met"] for c in result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
