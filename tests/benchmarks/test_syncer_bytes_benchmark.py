"""benchmarks/syncer_bytes.py: one real merge's bytes add up as the layout says, and the extrapolation's
arithmetic on hand-made figures."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.bench_scripts import load_script

bench = load_script("syncer_bytes")


def test_one_merge_moves_n_contributions_in_and_two_models_out(tmp_path: Path) -> None:
    m = bench.measure(tmp_path / "runs", learners=3, mb=0.25, codec="fp32", seed=0)
    params = 0.25 * 2**20 / 4
    assert m["params"] == params
    assert m["syncer_down_bytes"] == 3 * m["learner_up_bytes"]  # every learner's contribution, whole
    # an fp32 contribution is the model's bytes and a header; the version out is parameters + momentum
    assert 4 * params < m["learner_up_bytes"] < 4 * params + 4096
    assert 8 * params < m["syncer_up_bytes"] < 8 * params + 16384
    assert m["lockstep_up_bytes"] == pytest.approx(m["learner_up_bytes"] * 4 / 3)
    assert m["lockstep_down_bytes"] == pytest.approx(m["learner_up_bytes"] * 4 / 3)


def test_at_scale_takes_the_busier_direction_of_each_link() -> None:
    m = {
        "params": 10,
        "learner_up_bytes": 40,
        "learner_down_bytes": 40,
        "syncer_down_bytes": 320,
        "syncer_up_bytes": 80,
        "lockstep_up_bytes": 45,
        "lockstep_down_bytes": 70,
    }
    scaled = bench.at_scale(m, 8e9, [10.0])
    assert scaled["GB"]["syncer_down"] == pytest.approx(256.0)
    link = scaled["links"]["10Gbps"]
    assert link["syncer_s_per_merge"] == pytest.approx(256 / 1.25)
    assert link["learner_s_per_round"] == pytest.approx(32 / 1.25)
    assert link["lockstep_replica_s_per_round"] == pytest.approx(56 / 1.25)
