"""benchmarks/outlier_margin.py's arithmetic: the ratio it reports is the one ``robust.outliers`` compares with
the factor, and a cleared residual shows as the long-running replicas' ratio at the restore."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench_scripts import load_script

from composer_serverless.rendezvous.robust import outliers

bench = load_script("outlier_margin")


def test_the_ratio_is_the_one_the_rule_compares() -> None:
    """Hand-computed: the lower median of the non-zero (4, 1, 1, 0) is 1; 4 over it is 4, and the rule at
    factor 3.9 leaves out that one replica, at 4 none."""
    assert bench.lower_median_ratio([4.0, 1.0, 1.0, 0.0]) == [4.0, 1.0, 1.0, 0.0]
    assert list(outliers({0: 4.0, 1: 1.0, 2: 1.0, 3: 0.0}, 3.9, 4)) == [0]
    assert outliers({0: 4.0, 1: 1.0, 2: 1.0, 3: 0.0}, 4.0, 4) == {}


def test_a_cleared_residual_shows_at_the_restore(tmp_path: Path) -> None:
    args = argparse.Namespace(
        out=tmp_path,
        numel=8192,
        rounds=8,
        replicas=4,
        restored=2,
        restore_at=6,
        density=0.015,
        log_scale_spread=1.0,
        drift_keep=0.9,
        seed=0,
    )
    result = bench.simulate(args)
    restore = result["rounds"][5]
    assert restore["round"] == 6
    # Before it all four carry residuals alike; at it, two send their pseudo-gradient alone.
    assert result["steady_ratio_max"] < 1.5
    assert min(restore["norms"][:2]) > 2 * max(restore["norms"][2:])
    assert result["after_restore_ratio_max_all"] == max(restore["ratios_all"]) > 2
