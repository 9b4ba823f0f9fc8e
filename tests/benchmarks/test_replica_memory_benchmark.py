"""benchmarks/replica_memory.py: one measurement of a tiny model's replica, in this process, for each mode."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_scripts import load_script

bench = load_script("replica_memory")


@pytest.mark.parametrize("mode", list(bench.MODES))
def test_a_measurement_of_each_mode(tmp_path: Path, tiny_model_dir: Path, mode: str) -> None:
    row = bench.measure(tiny_model_dir, bench.MODES[mode], False, str(tmp_path / "store"))
    assert row["peak_bytes"] > 0 and row["bytes_per_param"] == pytest.approx(
        row["peak_bytes"] / row["params"], abs=0.01
    )
    if "LoRA" in mode:
        assert 0 < row["trainable_params"] < row["params"]
    else:
        assert row["trainable_params"] == row["params"]


def test_arguments(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--layers", "2"])  # --out is required
