"""What logging to a tracker costs, where: the figures behind relaying metrics from the store (the launcher)
rather than having every replica log itself.

    python benchmarks/tracking.py --out bench-out/tracking
    python benchmarks/tracking.py --out bench-out/tracking --replicas 8 --rounds 50 --sync-every 20

1. ``clients``: per tracker (TensorBoard's event writer, trackio local, W&B offline), in a fresh interpreter,
   the seconds to import and open a run, the memory that adds (the process's resident set and its child
   processes': W&B runs a service beside the process) and the seconds to close it. Each replica logging
   itself would pay this on every replica, on every start and restart, beside training.
2. ``relay``: a finished run's store (a local directory) of ``--replicas`` x ``--rounds`` rows with
   ``--sync-every`` step rows each, shaped like the replicas' (``replicas/meter.py``), relayed to TensorBoard
   from nothing: seconds, store reads, bytes read, writes (claims, the lease), steps logged; then a second
   relay of the same run (what ``status`` does when nothing is new): the same, with 0 steps logged.

Writes ``results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from composer_serverless.config import validate_config
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import Body, ObjectStore
from composer_serverless.tracking.relay import Relay

# Run in a fresh interpreter per tracker, so each import and its memory are its own.
_CLIENT = r"""
import json, sys, time, psutil
from pathlib import Path
from composer_serverless.config.outputs import TrackingConfig
name, directory = sys.argv[1], Path(sys.argv[2])
me = psutil.Process()
def rss():
    return me.memory_info().rss + sum(c.memory_info().rss for c in me.children(recursive=True))
before = rss()
start = time.perf_counter()
from composer_serverless.tracking.trackers import open_tracker
tracking = TrackingConfig(report_to=(name,), project="bench", wandb_mode="offline", dir=str(directory))
tracker = open_tracker(name, tracking, "bench", {"bench": True}, directory)
opened = time.perf_counter() - start
children = [c.name() for c in me.children(recursive=True)]
for step in range(1, 101):
    tracker.log(step, {"train/loss": 1.0 / step})
added = rss() - before
start = time.perf_counter()
tracker.close()
closed = time.perf_counter() - start
print(json.dumps({"open_s": opened, "added_rss_mb": added / 2**20, "close_s": closed, "processes_beside": children}))
"""


def clients(work: Path) -> dict[str, Any]:
    out = {}
    for name in ("tensorboard", "trackio", "wandb"):
        env = {"TRACKIO_DIR": str(work / "trackio"), "WANDB_SILENT": "true"}
        result = subprocess.run(
            [sys.executable, "-c", _CLIENT, name, str(work / name)],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, **env},
        )
        if result.returncode != 0:
            raise RuntimeError(f"{name}: {result.stderr[-2000:]}")
        out[name] = json.loads(result.stdout.strip().splitlines()[-1])
    return out


def _step(i: int) -> dict[str, Any]:
    return {
        "loss": 2.0 - i * 1e-3,
        "lr": 1e-4,
        "grad_norm": 0.5,
        "tokens": 4096.0,
        "tokens_per_s": 20000.0,
        "generate_tokens_per_s": None,
        "lm/loss": 2.0,
        "lm/tokens": 4096.0,
        "time_s": {"generate": 0.0, "forward_backward": 0.15, "optimizer": 0.05, "sync": 0.0, "step": 0.2},
        "device_peak_bytes": 30 * 2**30,
    }


class _CountingStore(ObjectStore):
    """The run's store, counting what a relay reads from it and writes to it."""

    reads = 0
    read_bytes = 0
    listings = 0
    writes = 0

    def put(self, key: str, data: Body) -> None:
        _CountingStore.writes += 1
        super().put(key, data)

    def create(self, key: str, data: Body) -> bool:
        _CountingStore.writes += 1
        return super().create(key, data)

    def get(self, key: str) -> bytes:
        data = super().get(key)
        _CountingStore.reads += 1
        _CountingStore.read_bytes += len(data)
        return data

    def list(self, prefix: str) -> list[str]:
        _CountingStore.listings += 1
        return super().list(prefix)


def relay(work: Path, replicas: int, rounds: int, sync_every: int) -> dict[str, Any]:
    config = validate_config(
        {
            "run_id": "bench",
            "store": str(work / "store"),
            "model": {"tiny": {}},
            "diloco": {"replicas": replicas, "sync_every": sync_every, "rounds": rounds},
            "tracking": {"report_to": ["tensorboard"], "dir": str(work / "relay")},
        }
    )
    run = ObjectStore(str(work / "store")).child("bench")
    row_bytes = 0
    for rank in range(replicas):
        for k in range(1, rounds + 1):
            row = {
                "rank": rank,
                "round": k,
                "participants": list(range(replicas)),
                "step_rows": [_step(i) for i in range(sync_every)],
                "bytes_up": 10**9,
                "bytes_down": 10**9,
                "time_s": {"sync": 1.0},
                "blocked_s": 1.0,
                "round_s": 60.0,
                "eval": {"eval/loss": 2.0} if rank == 0 else {},
            }
            data = json.dumps(row, sort_keys=True).encode()
            row_bytes += len(data)
            run.put(layout.metrics(rank, k), data)
    counted = _CountingStore(str(work / "store")).child("bench")
    out: dict[str, Any] = {"replicas": replicas, "rounds": rounds, "sync_every": sync_every}
    out["row_kb_per_replica_round"] = row_bytes / (replicas * rounds) / 1024
    for label in ("from_nothing", "nothing_new"):
        _CountingStore.reads = _CountingStore.read_bytes = _CountingStore.listings = _CountingStore.writes = 0
        start = time.perf_counter()
        relayer = Relay(counted, config)
        steps = relayer.catch_up(ended=True)
        relayer.close()
        out[label] = {
            "seconds": time.perf_counter() - start,
            "steps_logged": steps,
            "store_reads": _CountingStore.reads,
            "store_listings": _CountingStore.listings,
            "store_writes": _CountingStore.writes,
            "mb_read": _CountingStore.read_bytes / 2**20,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--sync-every", type=int, default=20)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        results = {
            "clients": clients(work),
            "relay": relay(work, args.replicas, args.rounds, args.sync_every),
        }
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
