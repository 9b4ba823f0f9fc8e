"""The rollout-speed benchmark's worker measures every engine on the same workload (tiny model)."""

import pytest

from tests.benchmarks.bench_scripts import load_script


@pytest.fixture(scope="module")
def benchmark():
    return load_script("rollout_speed")


@pytest.mark.parametrize("engine", ["reference", "static", "paged"])
def test_worker_measures_an_engine(benchmark, engine):
    spec = {
        "device": "cpu",
        "shape": "tiny",
        "engine": engine,
        "prompts": 2,
        "group": 2,
        "prompt_len": 5,
        "max_new_tokens": 6,
        "temperature": 1.0,
        "calls": 1,
        "threads": 1,
    }
    result = benchmark._worker(spec)
    # Random weights almost never sample the EOS: 4 rows of up to 6 tokens, each at least one.
    assert 4 <= result["tokens"] <= 24
    assert result["tokens_per_s"] > 0 and result["first_token_s"] > 0 and result["peak_bytes"] >= 0
