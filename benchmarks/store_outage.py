"""A store outage mid-run: how soon the run is back to work once the store takes writes again.

    python benchmarks/store_outage.py --out bench-out/store-outage                # 15 s outage
    python benchmarks/store_outage.py --out bench-out/store-outage-quick --outage-s 3 --rounds 6

Two replica processes of the demo's model (``deploy/configs/local-demo.toml``, 2 replicas) train through a
``file://`` store under ``--out``. Each reads and writes the store through the fault-injecting twin of the
worker (``tests/rendezvous/replica_process.py`` with ``FaultyStore(outage=...)``): from the moment round
``--outage-after`` is recorded, every write of both replicas fails as on a full disk (ENOSPC) for
``--outage-s`` seconds, heartbeats, uploads, quorum and checkpoints alike. Nothing else is changed: the
replicas ride it out with the store's outage window (``diloco.store_outage_s``).

Figures, from the store's metrics rows (their ``time`` and ``round_s``):

- ``normal_round_s``: the median ``round_s`` of the rounds that ended before the outage began;
- ``recovery_s``: from the end of the outage to the first round that commits after it;
- ``recovery_to_round``: their ratio (at most 2 is the target: the round after the outage is late by about
  one round, not by ``sync_timeout_s``);
- every round's participants, the replicas' agreement (one digest per round) and the temporary files left.

Writes ``results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from composer_serverless.config import load_config
from composer_serverless.launch.launcher import create_run
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import read_metrics

REPO = Path(__file__).resolve().parents[1]
TWIN = REPO / "tests" / "rendezvous" / "replica_process.py"
DEMO = REPO / "deploy" / "configs" / "local-demo.toml"
TIMEOUT_S = 900


def summarise(rows: dict[int, list[dict[str, Any]]], began: float, ended: float) -> dict[str, Any]:
    """The figures of a finished run from its metrics rows and the outage's start and end (``time.time()``)."""
    committed = [row for rank_rows in rows.values() for row in rank_rows if row.get("round", 0) > 0]
    before = [row["round_s"] for row in committed if "round_s" in row and row["time"] < began]
    after = sorted(row["time"] for row in committed if row["time"] > ended)
    normal = statistics.median(before)
    recovery = after[0] - ended
    digests: dict[int, set[str]] = {}
    for row in committed:
        if "global_sha256" in row:
            digests.setdefault(row["round"], set()).add(row["global_sha256"])
    return {
        "normal_round_s": normal,
        "recovery_s": recovery,
        "recovery_to_round": recovery / normal,
        "participants": {row["round"]: row["participants"] for row in rows[0] if "participants" in row},
        "bit_identical": all(len(d) == 1 for d in digests.values()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--outage-s", type=float, default=15.0)
    parser.add_argument(
        "--outage-after", type=int, default=3, help="the outage begins once this round is recorded"
    )
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args(argv)
    out: Path = args.out.absolute()
    out.mkdir(parents=True, exist_ok=True)
    config = load_config(
        DEMO,
        [
            f"store=file://{out}/runs",
            f"run_id=outage-{int(time.time())}",
            "diloco.replicas=2",
            "diloco.min_replicas=2",
            f"diloco.rounds={args.rounds}",
        ],
    )
    run, _ = create_run(config, str(DEMO), Console(quiet=True))
    start, end = out / "outage-start", out / "outage-end"
    for marker in (start, end):
        marker.unlink(missing_ok=True)
    faults = json.dumps({"outage": [str(start), str(end)]})
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs = []
    for rank in range(2):
        with open(out / f"rank-{rank}.log", "wb") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(TWIN), "--run", run.url, "--rank", str(rank), "--faults", faults],
                    cwd=TWIN.parent,
                    env={**os.environ, **env},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not run.exists(layout.metrics(0, args.outage_after)):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise SystemExit(f"the run did not reach round {args.outage_after}; see {out}/rank-*.log")
            time.sleep(0.05)
        began = time.time()
        start.touch()
        time.sleep(args.outage_s)
        ended = time.time()
        end.touch()
        codes = [p.wait(timeout=TIMEOUT_S) for p in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    results = {
        "outage_s": args.outage_s,
        "outage_after_round": args.outage_after,
        "rounds": args.rounds,
        "exit_codes": codes,
        "temporary_files_left": sum(1 for p in (out / "runs").rglob("*") if ".tmp-" in p.name),
        **summarise(read_metrics(ObjectStore(run.url)), began, ended),
    }
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(json.dumps({k: v for k, v in results.items() if k != "participants"}, indent=2))
    return 0 if codes == [0, 0] else 1


if __name__ == "__main__":
    sys.exit(main())
