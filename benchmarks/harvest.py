"""Harvest throughput against its latency bound: N teachers that each take a fixed time to answer.

    python benchmarks/harvest.py --out bench-out/harvest                      # 3 teachers, 200 ms, 100 states, 16
    python benchmarks/harvest.py --out bench-out/harvest-quick --states 20 --latency-s 0.05

Three fake OpenAI-compatible teachers on loopback (``tests/harvest/fake_teacher.py``: ``ThreadingHTTPServer``,
HTTP/1.1 keep-alive, the OpenAI response shape with usage) answer every request after ``--latency-s``. They run
in a process of their own (``python -m tests.harvest.fake_teacher``), as a remote teacher would, so their threads do not share the harvest's interpreter.
The harvest asks each teacher about every state, ``--concurrency`` requests in flight per teacher, through the
real client, cap and cache (a fresh cache directory under ``--out`` per repeat, so every answer is a request).

The ideal: teachers are asked in parallel and each keeps ``concurrency`` requests in flight, so no harvest can
be faster than ``ceil(states / concurrency) * latency_s``. ``ratio`` is the measured wall time over it (the
target: at most 1.3). A run from the filled cache is timed too (no request at all). Writes ``results.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

from composer_serverless.config import HarvestConfig
from composer_serverless.harvest.cache import AnswerCache
from composer_serverless.harvest.costs import Budget
from composer_serverless.harvest.harvester import harvest
from composer_serverless.harvest.states import State
from composer_serverless.rendezvous.store import ObjectStore

REPO = Path(__file__).resolve().parents[1]

KEY_ENV = "HARVEST_BENCH_KEY"


def ideal_s(states: int, concurrency: int, latency_s: float) -> float:
    """The latency bound: each teacher answers ``concurrency`` states per latency, all teachers at once."""
    return math.ceil(states / concurrency) * latency_s


def measure(
    teachers: int, states: int, concurrency: int, latency_s: float, repeats: int, out: Path
) -> dict[str, Any]:
    key = f"bench-{os.getpid()}"
    os.environ[KEY_ENV] = key
    server = subprocess.Popen(
        [sys.executable, "-m", "tests.harvest.fake_teacher", str(teachers), str(latency_s)],
        cwd=REPO,
        env={**os.environ, "FAKE_TEACHER_KEY": key, "PYTHONPATH": str(REPO)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdin is not None and server.stdout is not None
    try:
        line = server.stdout.readline()
        if not line:
            raise SystemExit(f"the fake teachers did not start (exit {server.wait()})")
        urls = json.loads(line)
        config = HarvestConfig.model_validate(
            {
                "teachers": [
                    {
                        "name": f"t{i}",
                        "base_url": url,
                        "model": f"m{i}",
                        "api_key_env": KEY_ENV,
                        "usd_per_m_input": 1.0,
                        "usd_per_m_output": 4.0,
                        "concurrency": concurrency,
                        "max_tokens": 8,
                    }
                    for i, url in enumerate(urls)
                ],
                "threshold": min(2, teachers),
                "max_usd": 100.0,
            }
        )
        trace = [State(str(i), f"state {i}: what is 6 x 7?", "41") for i in range(states)]
        walls, cached_walls = [], []
        for repeat in range(repeats):
            cache = AnswerCache(ObjectStore(str(out / f"cache-{repeat}")))
            started = time.perf_counter()
            result = asyncio.run(harvest(trace, config, cache, Budget(Fraction(100))))
            walls.append(time.perf_counter() - started)
            sent = [t.requests for t in result.teachers]
            assert sent == [states] * teachers and len(result.pairs) == states, (sent, len(result.pairs))
            started = time.perf_counter()
            again = asyncio.run(harvest(trace, config, cache, Budget(Fraction(100))))
            cached_walls.append(time.perf_counter() - started)
            assert again.spent == 0 and [t.requests for t in again.teachers] == [0] * teachers
        server.stdin.write("stats\n")
        server.stdin.flush()
        in_flight = json.loads(server.stdout.readline())
        ideal = ideal_s(states, concurrency, latency_s)
        wall = statistics.median(walls)
        return {
            "teachers": teachers,
            "states": states,
            "concurrency": concurrency,
            "latency_s": latency_s,
            "ideal_s": ideal,
            "ideal_formula": "ceil(states / concurrency) * latency_s: every teacher is asked in parallel, "
            "each with concurrency requests in flight",
            "wall_s": wall,
            "wall_s_each": walls,
            "ratio": wall / ideal,
            "target_ratio": 1.3,
            "requests": states * teachers,
            "max_in_flight": in_flight,
            "cached_wall_s": statistics.median(cached_walls),
            "repeats": repeats,
        }
    finally:
        server.stdin.close()
        server.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--teachers", type=int, default=3)
    parser.add_argument("--states", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--latency-s", type=float, default=0.2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    out: Path = args.out.absolute()
    out.mkdir(parents=True, exist_ok=True)
    results = measure(args.teachers, args.states, args.concurrency, args.latency_s, args.repeats, out)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0 if results["ratio"] <= results["target_ratio"] else 1


if __name__ == "__main__":
    sys.exit(main())
