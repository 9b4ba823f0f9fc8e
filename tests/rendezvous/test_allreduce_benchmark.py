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


def each_phase(phases: tuple[str, ...], n: int, replica) -> None:
    """Run ``replica(rank, phase)`` for N ranks at once (threads), one phase after the other."""
    for phase in phases:
        threads = [threading.Thread(target=replica, args=(r, phase)) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)


@pytest.mark.parametrize("name", ["int8", "sparse"])
def test_phases_and_summary_report_bytes_against_the_bound(tmp_path: Path, name: str) -> None:
    """int8, and the sparse codec against the bound of its own payload size (the owners' averages
    re-sparsified: every object of the exchange is the sparse size)."""
    bench = load_benchmark()
    n, mb = 3, 1.0
    args = argparse.Namespace(replicas=n, mb=mb, store="file", codec=name, density=0.015, repeats=1)
    codec = bench.wire_codec(args)
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

    each_phase(bench.PHASES, n, replica)
    result = bench.summarise(samples, args)

    wire = result["wire_bytes"]
    assert result["payload_bytes"] == 2**20
    assert result["payload_bytes"] / wire >= (3.9 if name == "int8" else 100)
    assert result["compression_vs_fp32"] == pytest.approx(result["payload_bytes"] / wire, rel=0.01)
    assert result["bound_down_bytes"] == 2 * (n - 1) / n * wire
    assert 1.0 <= result["ratio_to_bound"] <= 1.05
    # Both directions: the inputs and the owned reduced shard up, the peers' inputs and reduced shards down.
    assert result["bound_bytes_per_replica"] == pytest.approx(wire * (1 + 1 / n) + result["bound_down_bytes"])
    assert 1.0 <= result["bytes_ratio_to_bound"] <= 1.05
    # The raw phase moves exactly the bound's download; everyone-reads-everything moves N/2 times it (one
    # header per replica where the shards have N: a little less, for the sparse codec's small payloads).
    assert abs(result["phases"]["raw"]["bytes_down_per_replica"] / result["bound_down_bytes"] - 1) < 1e-3
    assert abs(result["naive_ratio_to_bound"] - n / 2) < (0.01 if name == "int8" else 0.15)
    for key in ("wall_s", "naive_wall_s", "store_MBps", "time_ratio_to_bound", "time_ratio_to_down_bound"):
        assert result[key] > 0
    # The bound's time counts its upload (S_wire) and its download at the raw phase's throughput.
    assert result["bound_up_bytes"] == wire
    expected_s = (wire + result["bound_down_bytes"]) / 1e6 / result["store_MBps"]
    assert abs(result["bound_s"] - expected_s) < 1e-9
    # The checksum phase hashes what the exchange hashes: every byte it writes and every byte it reads.
    hashed = result["phases"]["checksum"]
    ours = result["phases"]["allreduce"]
    # (The exchange also reads the quorum record, and a reduced shard's header names whose inputs it sums: a
    # few hundred bytes, 2.5 % of the sparse codec's payloads of 1 MiB.)
    assert hashed["bytes_up_per_replica"] + hashed["bytes_down_per_replica"] == pytest.approx(
        ours["bytes_up_per_replica"] + ours["bytes_down_per_replica"], rel=1e-3 if name == "int8" else 0.05
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


@pytest.mark.parametrize("name", ["fp32", "int8", "sparse"])
def test_link_phases_move_each_codecs_wire_size(tmp_path: Path, name: str) -> None:
    """The emulated link's probe moves the bound's traffic at the codec's own wire size (it once built its
    objects as fp32 data behind a header, and failed for any codec smaller than fp32), and the exchange runs
    beside it with that codec."""
    bench = load_benchmark()
    n, numel = 3, 300_000
    args = argparse.Namespace(codec=name, density=0.015)
    codec = bench.wire_codec(args)
    url = f"file://{tmp_path}/store"
    shards = bench.shard_bounds(numel, n)
    wire = [len(bench.encode(torch.zeros(b - a), bench.IDENTITY, codec)) for a, b in shards]
    moved: dict[tuple[str, int], tuple[int, int]] = {}

    def replica(rank: int, phase: str) -> None:
        values = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        sequential = bench.ObjectStore(url, transfers=bench.Transfers(1))
        phases = bench.link_phase_functions(values, n, codec, bench.Transfers(2), sequential)
        store = bench.ObjectStore(url, transfers=bench.Transfers(2))
        moved[phase, rank] = phases[phase](store, phase, values, rank, n, codec)

    each_phase(bench.LINK_PHASES, n, replica)
    for rank in range(n):
        up, down = moved["probe", rank]
        # Up: one object per owner; down: the other replicas' objects for this owner, and their own shards.
        assert up == sum(wire)
        assert down == sum(wire[rank] for p in range(n) if p != rank) + sum(
            wire[p] for p in range(n) if p != rank
        )
        # Both exchanges read the same objects with their real headers (and the quorum record): within 5 %.
        for exchange in ("allreduce", "sequential"):
            assert moved[exchange, rank][1] == pytest.approx(down, rel=0.05)
