"""The memory benchmark's worker builds valid batches and measures something, for both losses (tiny model)."""

import pytest

from tests.benchmarks.bench_scripts import load_script


@pytest.fixture(scope="module")
def benchmark():
    # Through the shared loader, which puts benchmarks/ on the path for the script's own imports: loaded
    # by hand, it passed or failed with the order the suite ran in.
    return load_script("loss_memory")


@pytest.mark.parametrize("loss", ["ce", "composer"])
def test_worker_measures_a_step(benchmark, loss):
    spec = {
        "size": "tiny",
        "device": "cpu",
        "batch": 4,
        "seq_len": 32,
        "steps": 1,
        "chunk_tokens": 16,
        "top_k": 8,
        "threads": 1,
        "loss": loss,
    }
    result = benchmark._worker(spec)
    assert result["peak_bytes"] >= 0 and result["step_s"] > 0
    assert result["params"] > 0 and result["vocab"] == 64
