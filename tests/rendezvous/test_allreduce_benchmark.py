"""The all-reduce benchmark's phases and summary, with replicas as threads (the script itself spawns
processes); tiny sizes, and no timing is asserted."""

from __future__ import annotations

import argparse
import importlib.util
import threading
import time
from pathlib import Path

import pytest
import torch
from harness import REPO

SCRIPT = REPO / "benchmarks" / "allreduce.py"


def load_benchmark():
    spec = importlib.util.spec_from_file_location("allreduce_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_phases_and_summary_report_bytes_against_the_bound(tmp_path: Path) -> None:
    bench = load_benchmark()
    n, mb, codec = 3, 1.0, "int8"
    samples = []

    def replica(rank: int, phase: str) -> None:
        values = torch.randn(int(mb * 2**20 / 4), generator=torch.Generator().manual_seed(rank))
        store = bench.ObjectStore(f"file://{tmp_path}/store")
        started = time.monotonic()
        up, down = bench.phase_functions(values, n, codec)[phase](store, phase, values, rank, n, codec)
        samples.append(
            {
                "phase": phase,
                "repeat": 1,
                "rank": rank,
                "start": started,
                "end": time.monotonic(),
                "up": up,
                "down": down,
            }
        )

    for phase in bench.PHASES:
        threads = [threading.Thread(target=replica, args=(r, phase)) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    args = argparse.Namespace(replicas=n, mb=mb, store="file", codec=codec, repeats=1)
    result = bench.summarise(samples, args)

    wire = result["wire_bytes"]
    assert result["payload_bytes"] == 2**20
    assert result["payload_bytes"] / wire >= 3.9
    assert result["bound_down_bytes"] == 2 * (n - 1) / n * wire
    assert 1.0 <= result["ratio_to_bound"] <= 1.05
    # The raw phase moves exactly the bound's download; everyone-reads-everything moves N/2 times it.
    assert abs(result["phases"]["raw"]["bytes_down_per_replica"] / result["bound_down_bytes"] - 1) < 1e-3
    assert abs(result["naive_ratio_to_bound"] - n / 2) < 0.01
    for key in ("wall_s", "naive_wall_s", "store_MBps", "time_ratio_to_bound", "time_ratio_to_down_bound"):
        assert result[key] > 0
    # The bound's time counts its upload (S_wire) and its download at the raw phase's throughput.
    assert result["bound_up_bytes"] == wire
    expected_s = (wire + result["bound_down_bytes"]) / 1e6 / result["store_MBps"]
    assert abs(result["bound_s"] - expected_s) < 1e-9
    # The checksum phase hashes what the exchange hashes: every byte it writes and every byte it reads.
    hashed = result["phases"]["checksum"]
    ours = result["phases"]["allreduce"]
    assert hashed["bytes_up_per_replica"] + hashed["bytes_down_per_replica"] == pytest.approx(
        ours["bytes_up_per_replica"] + ours["bytes_down_per_replica"], rel=1e-3
    )
    expected = result["wall_s"] / (result["bound_s"] + result["checksum_s"])
    assert result["time_ratio_to_bound_with_checksums"] == pytest.approx(expected)
    assert (
        abs(
            result["time_ratio_to_down_bound"] / result["time_ratio_to_bound"]
            - (wire + result["bound_down_bytes"]) / result["bound_down_bytes"]
        )
        < 1e-9
    )
