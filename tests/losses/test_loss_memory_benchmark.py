"""The memory benchmark's worker builds valid batches and measures something, for both losses (tiny model)."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "loss_memory.py"


@pytest.fixture(scope="module")
def benchmark():
    spec = importlib.util.spec_from_file_location("loss_memory", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
