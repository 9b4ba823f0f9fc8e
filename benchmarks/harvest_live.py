"""Is a run harvested live reproducible, and what do the replicas pay to wait for slow teachers?

    python benchmarks/harvest_live.py --out bench-out/harvest-live                  # 2 runs, teachers 1.5 s
    python benchmarks/harvest_live.py --out bench-out/harvest-live-fast --latency-s 0.05

The same config is launched ``--runs`` times: a composer run of the task suite's tiny model, 2 local replicas,
``--rounds`` rounds, ``harvest.live`` with the default schedule (``live_lag`` 1: round k's pairs taken at the
end of round k + 1) and wait. Three fake OpenAI-compatible teachers (``tests/harvest/fake_teacher.py``, in a
process of their own, as remote teachers would be) answer every request after ``--latency-s``; with 12 prompts
a harvest and 8 requests in flight per teacher a harvest takes two latencies, which at the default 1.5 s is
several times a round here, so the replicas wait for nearly every harvest. A fresh store per run: nothing is
answered from an earlier run's cache.

Compared between the runs: each round's harvest report (pairs, prompts, exact spend), the pairs themselves
(prompt, chosen, rejected), what each round's end took (``harvest/taken``), and every replica's rows (the
pair files replayed and taken, and the training loss, which the pairs feed). Reported, not compared: wall
times and how long each replica waited at each round's end. Writes ``results.json``; exits 1 if the runs
differ.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from composer_serverless.config import RunConfig
from composer_serverless.launch.launcher import launch
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import read_metrics

REPO = Path(__file__).resolve().parents[1]
KEY_ENV = "HARVEST_LIVE_BENCH_KEY"
# What must be equal from one run to the next, per replica and round.
ROW_FIELDS = ("replay_files", "replay_files_new", "train_loss")


def run_config(urls: list[str], store: Path, run_id: str, rounds: int) -> RunConfig:
    """The tests' live-harvest run (``tests/harvest/live_runs.py``) with these teachers."""
    if str(REPO) not in sys.path:  # run as a script, only benchmarks/ is on the path
        sys.path.insert(0, str(REPO))
    from tests.harvest.live_runs import composer_live_config

    teachers = [
        {
            "name": f"t{i}",
            "base_url": url,
            "model": f"model-{i}",
            "api_key_env": KEY_ENV,
            "usd_per_m_input": 2.0,
            "usd_per_m_output": 8.0,
            "max_tokens": 32,
        }
        for i, url in enumerate(urls)
    ]
    return composer_live_config(teachers, store, run_id, rounds, max_states=12)


def outcome(run: ObjectStore, rounds: int) -> dict[str, Any]:
    """What a finished run harvested, took and trained, as compared between runs (and the waits, which are
    not compared)."""
    reports = {}
    for k in range(1, rounds):
        if not run.exists(layout.harvest_report(k)):
            continue
        report = json.loads(run.get(layout.harvest_report(k)))
        pairs = []
        if report.get("pairs_file"):
            rows = [json.loads(line) for line in run.get(report["pairs_file"]).decode().splitlines()]
            pairs = sorted([p["prompt"], p["chosen"], p["rejected"]] for p in rows)
        reports[str(k)] = {
            "pairs": report.get("pairs", 0),
            "prompts": report.get("prompts"),
            "spent_exact": report["spent_exact"],
            "skipped": report.get("skipped"),
            "pair_rows": pairs,
        }
    taken = {}
    for name in run.list(layout.HARVEST_TAKEN):
        doc = json.loads(run.get(f"{layout.HARVEST_TAKEN}/{name}"))
        taken[str(doc["round"])] = {k: doc[k] for k in ("harvest_of", "take", "outcome")}
    rows: dict[str, dict[str, Any]] = {}
    waits: dict[str, dict[str, float]] = {}
    for rank, rank_rows in read_metrics(run).items():
        trained = {r["round"]: r for r in rank_rows if r["round"] > 0 and "train" in r}
        rows[str(rank)] = {str(j): {f: row.get(f) for f in ROW_FIELDS} for j, row in sorted(trained.items())}
        waits[str(rank)] = {
            str(j): row["harvest_wait_s"] for j, row in trained.items() if "harvest_wait_s" in row
        }
    return {"reports": reports, "taken": taken, "rows": rows, "waits": waits}


def compare(runs: list[dict[str, Any]]) -> dict[str, bool]:
    """Per part of the outcome, whether every run has the same as the first."""
    return {part: all(r[part] == runs[0][part] for r in runs[1:]) for part in ("reports", "taken", "rows")}


def start_teachers(latency_s: float, key: str) -> tuple[subprocess.Popen[str], list[str]]:
    server = subprocess.Popen(
        [sys.executable, "-m", "tests.harvest.fake_teacher", "3", str(latency_s)],
        cwd=REPO,
        env={**os.environ, "FAKE_TEACHER_KEY": key, "PYTHONPATH": str(REPO)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdout is not None
    return server, json.loads(server.stdout.readline())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--latency-s", type=float, default=1.5)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    key = f"bench-{os.getpid()}"
    os.environ[KEY_ENV] = key
    server, urls = start_teachers(args.latency_s, key)
    runs = []
    try:
        for index in range(args.runs):
            run_id = f"live-{index}"
            store = args.out / "runs"
            started = time.monotonic()
            summary = launch(
                run_config(urls, store, run_id, args.rounds), "harvest_live.py", Console(file=io.StringIO())
            )
            wall = time.monotonic() - started
            assert summary is not None and summary["rounds_committed"] == args.rounds, summary
            result = outcome(ObjectStore(str(store / run_id)), args.rounds)
            waited = sum(w for rank in result["waits"].values() for w in rank.values())
            runs.append({"run_id": run_id, "wall_s": wall, "waited_s": waited, **result})
            print(f"{run_id}: {wall:.1f}s, the replicas waited {waited:.1f}s in all", flush=True)
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(timeout=30)
    same = compare(runs)
    results = {
        "runs": args.runs,
        "rounds": args.rounds,
        "latency_s": args.latency_s,
        "identical": same,
        "outcomes": runs,
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({"identical": same, "wall_s": [r["wall_s"] for r in runs]}))
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
