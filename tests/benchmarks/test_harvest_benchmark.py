"""benchmarks/harvest.py: the latency bound by hand, and one small measurement through the real harvest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_scripts import load_script

bench = load_script("harvest")


def test_the_ideal_is_whole_waves_of_concurrency():
    assert bench.ideal_s(100, 16, 0.2) == pytest.approx(7 * 0.2)  # 6 full waves and one of 4
    assert bench.ideal_s(96, 16, 0.2) == pytest.approx(6 * 0.2)
    assert bench.ideal_s(1, 16, 0.5) == 0.5


def test_a_small_measurement(tmp_path: Path):
    code = bench.main(
        ["--out", str(tmp_path), "--teachers", "2", "--states", "6", "--concurrency", "3"]
        + ["--latency-s", "0.05", "--repeats", "1"]
    )
    results = json.loads((tmp_path / "results.json").read_text())
    assert (results["requests"], results["max_in_flight"], results["ideal_s"]) == (
        12,
        [3, 3],
        pytest.approx(0.1),
    )
    assert results["wall_s"] >= results["ideal_s"] and code in (0, 1)


def test_the_served_harvest_spreads_its_states_over_the_tasks():
    serve = load_script("harvest_serve")
    traces = [{"task": t, "n": i} for t in ("a", "b", "c") for i in range(3)]
    picked = serve.spread(traces, 5)
    assert [(p["task"], p["n"]) for p in picked] == [("a", 0), ("b", 0), ("c", 0), ("a", 1), ("b", 1)]
