"""benchmarks/convergence.py: its arithmetic with hand-computed numbers, the variants' configs, its argument
checks, and a microscopic run of data-parallel against one real DiLoCo launch. No timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_scripts import load_script

from composer_serverless.config import load_config

bench = load_script("convergence")
DEMO = Path(__file__).resolve().parents[2] / "deploy" / "configs" / "local-demo.toml"


def run_row(name: str, seed: int, eval_loss: float, gap: float, bytes_: float, **extra) -> dict:
    return {
        "name": name,
        "seed": seed,
        "eval_loss": eval_loss,
        "gap_vs_dp": gap,
        "bytes_communicated": bytes_,
        "rounds": 1,
        **extra,
    }


def test_gap_is_a_fraction_of_the_data_parallel_loss() -> None:
    assert bench.gap(4.04, 4.0) == pytest.approx(0.01)  # 1 % above
    assert bench.gap(3.96, 4.0) == pytest.approx(-0.01)


def test_bytes_arithmetic_by_hand() -> None:
    # 1,000 parameters in fp32 are 4,000 bytes a copy; 4 replicas move 3*4-1 = 11 copies per sync.
    assert bench.copies_per_sync(4) == 11 and bench.copies_per_sync(1) == 2
    per_sync = 11 * 4000
    assert bench.wire_bits(2 * per_sync, rounds=2, replicas=4, parameters=1000) == pytest.approx(32.0)
    # Data-parallel: one such exchange per inner step, T = 1,000 steps.
    dp = bench.dp_bytes(1000, per_sync)
    assert dp == 44_000_000
    # DiLoCo, H = 10 in fp32: 100 rounds, exactly H times less.
    fp32 = bench.bytes_check(dp, 100 * per_sync, sync_every=10, bits=32.0)
    assert fp32 == {"ratio": pytest.approx(10.0), "bound": pytest.approx(10.0), "met": True}
    # int8 with one fp32 scale per 256 values: 8 + 32/256 = 8.125 bits; bound 10 * 32 / 8.125 = 39.38.
    int8_bytes = 100 * 11 * 1000 * 8.125 / 8
    int8 = bench.bytes_check(dp, int8_bytes, sync_every=10, bits=8.125)
    assert int8["ratio"] == pytest.approx(39.3846, abs=1e-3) and int8["met"]
    assert not bench.bytes_check(dp, 2 * int8_bytes, sync_every=10, bits=8.125)["met"]


def test_means_over_seeds_and_the_acceptance_checks() -> None:
    runs = [
        run_row("dp", 0, 4.0, 0.0, 1000.0, replicas=4, sync_every=1),
        run_row("dp", 1, 5.0, 0.0, 1000.0, replicas=4, sync_every=1),
        run_row("diloco-h10", 0, 4.02, 0.005, 100.0, replicas=4, sync_every=10, wire_bits=32.0),
        run_row("diloco-h10", 1, 5.1, 0.02, 100.0, replicas=4, sync_every=10, wire_bits=32.0),
        run_row("diloco-n1-h10", 0, 3.96, -0.01, 20.0, replicas=1, sync_every=10, wire_bits=32.0),
        run_row(
            "diloco-n8-h10", 0, 4.1, 0.025, 1000.0 * 23 / 11 / 10, replicas=8, sync_every=10, wire_bits=32.0
        ),
        run_row("fedavg-h10", 0, 4.7, 0.1, 100.0, replicas=4, sync_every=10, wire_bits=32.0),
        run_row("diloco-h10-int8", 0, 4.57, 0.01, 25.0, replicas=4, sync_every=10, wire_bits=8.0),
    ]
    means = bench.mean_over_seeds(runs)
    assert means["dp"]["eval_loss"] == 4.5
    assert means["diloco-h10"]["eval_loss"] == pytest.approx(4.56)
    assert means["diloco-h10"]["gap_vs_dp"] == pytest.approx(0.0125)  # (0.5 % + 2 %) / 2
    assert means["diloco-h10"]["gap_vs_dp_per_seed"] == [0.005, 0.02]
    checks = bench.checks(means, runs)
    assert not checks["n4_h10_within_1pct_of_dp"]["met"]
    assert checks["n1_at_or_below_dp"]["met"]
    assert checks["n8_h10_within_2pct_of_dp"] == {"gap_vs_dp": 0.025, "threshold": 0.02, "met": False}
    assert checks["nesterov_at_or_ahead_of_fedavg"] == {
        "nesterov": pytest.approx(4.56),
        "fedavg": 4.7,
        "met": True,
    }
    # int8 4.57 against fp32's mean 4.56: +0.22 %.
    assert checks["int8_within_half_pct_of_fp32"]["relative"] == pytest.approx(4.57 / 4.56 - 1)
    assert checks["int8_within_half_pct_of_fp32"]["met"]
    assert checks["bytes_diloco-h10_seed0"] == {"ratio": 10.0, "bound": 10.0, "met": True}
    assert checks["bytes_diloco-h10-int8_seed0"]["ratio"] == 40.0
    assert "bytes_diloco-n1-h10_seed0" not in checks  # one replica exchanges with nobody
    # N = 8 against data-parallel among 8, whose all-reduce moves 3N - 1 = 23 copies per step where 4's moves
    # 11: data-parallel's 1,000 bytes among 4 are 1,000 x 23 / 11 among 8, ten times this H = 10 run's.
    assert checks["bytes_diloco-n8-h10_seed0"]["ratio"] == pytest.approx(10.0)


def test_without_data_parallel_there_are_no_gaps_to_check() -> None:
    """``--only diloco-h10,fedavg-h10``: the losses and the outer-step comparison, and nothing against DP."""
    runs = [
        {**run_row("diloco-h10", 1, 4.4589, 0.0, 100.0, replicas=4, sync_every=10), "gap_vs_dp": None},
        {**run_row("fedavg-h10", 1, 4.4608, 0.0, 100.0, replicas=4, sync_every=10), "gap_vs_dp": None},
    ]
    means = bench.mean_over_seeds(runs)
    assert means["diloco-h10"]["gap_vs_dp"] is None
    assert bench.checks(means, runs) == {
        "nesterov_at_or_ahead_of_fedavg": {"nesterov": 4.4589, "fedavg": 4.4608, "met": True}
    }


def test_compression_is_against_the_fp32_run_of_the_same_seed_n_and_h() -> None:
    """compression_vs_fp32 divides the fp32 Nesterov run's bytes of the same seed, N and H by the run's own;
    the sparse check needs both >= 100 and the loss within +0.5 % of fp32's mean."""

    def row(name: str, seed: int, loss: float, bytes_: float, h: int, codec: str) -> dict:
        return run_row(name, seed, loss, 0.0, bytes_, replicas=4, sync_every=h, codec=codec, outer="nesterov")

    runs = [
        row("diloco-h10", 1, 4.0, 12_000.0, 10, "fp32"),
        row("diloco-h10", 2, 5.0, 12_000.0, 10, "fp32"),
        row("diloco-h50", 1, 4.4, 2_400.0, 50, "fp32"),
        {**row("diloco-h10-sparse", 1, 4.02, 100.0, 10, "sparse"), "codec_carried": 0.1},
        {**row("diloco-h10-sparse", 2, 5.02, 120.0, 10, "sparse"), "codec_carried": 0.3},
        row("diloco-h50-sparse", 1, 4.84, 30.0, 50, "sparse"),
    ]
    runs = [{**r, "gap_vs_dp": None} for r in runs]
    bench.compression(runs)
    assert [r.get("compression_vs_fp32") for r in runs] == [1.0, 1.0, 1.0, 120.0, 100.0, 80.0]
    means = bench.mean_over_seeds(runs)
    assert means["diloco-h10-sparse"]["compression_vs_fp32"] == 110.0
    assert means["diloco-h10-sparse"]["codec_carried"] == pytest.approx(0.2)
    assert "codec_carried" not in means["diloco-h10"]
    checks = bench.checks(means, runs)
    # 4.52 against 4.5: +0.44 %, at 110x: met; at H = 50, 4.84 against 4.4 (+10 %) at 80x: reported.
    assert checks["sparse_h10_100x_within_half_pct_of_fp32"] == {
        "relative": pytest.approx(4.52 / 4.5 - 1),
        "compression_vs_fp32": 110.0,
        "threshold": 0.005,
        "met": True,
    }
    assert checks["sparse_h50_vs_fp32"]["relative"] == pytest.approx(0.1)
    assert checks["sparse_h50_vs_fp32"]["compression_vs_fp32"] == 80.0
    assert "met" not in checks["sparse_h50_vs_fp32"]


def test_variant_configs_change_one_thing_and_keep_the_tokens() -> None:
    base = load_config(DEMO)
    budget = bench.Budget(steps=1000, batch_size=8, seq_len=64, eval_every=50, eval_sequences=256, seeds=(0,))
    by_name = {v.name: v for v in bench.VARIANTS}
    out = Path("/nonexistent")

    def config(name):
        return bench.variant_config(base, by_name[name], budget, 1, Path("/models/seed-1"), out)

    h10, h50, n1, n8, fedavg, int8 = (
        config(n)
        for n in (
            "diloco-h10",
            "diloco-h50",
            "diloco-n1-h10",
            "diloco-n8-h10",
            "fedavg-h10",
            "diloco-h10-int8",
        )
    )
    assert (h10.diloco.rounds, h10.eval.every_rounds) == (100, 5)
    assert (h50.diloco.rounds, h50.eval.every_rounds) == (20, 1)
    assert h10.diloco.min_replicas == 4 and h10.seed == 1 and h10.model.path == "/models/seed-1"
    # One replica gets the global batch: the same tokens per inner step.
    assert (n1.diloco.replicas, n1.data.batch_size, h10.data.batch_size) == (1, 32, 8)
    assert (n8.diloco.replicas, n8.data.batch_size, n8.diloco.min_replicas) == (8, 4, 8)
    assert (fedavg.diloco.outer_lr, fedavg.diloco.outer_momentum, fedavg.diloco.nesterov) == (1.0, 0.0, False)
    assert (h10.diloco.outer_lr, h10.diloco.outer_momentum, h10.diloco.nesterov) == (0.7, 0.3, True)
    assert int8.diloco.codec == "int8" and h10.diloco.codec == "fp32"
    sparse, dense = config("diloco-h50-sparse"), config("diloco-h10-sparse-dense")
    assert (sparse.diloco.codec, sparse.diloco.sync_every, sparse.diloco.reduced_codec) == (
        "sparse",
        50,
        None,
    )
    assert (dense.diloco.codec, dense.diloco.reduced_codec, h10.diloco.reduced_codec) == (
        "sparse",
        "fp32",
        None,
    )
    assert h10.train == base.train == n1.train


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "75"], "multiple of 50"),
        (["--seeds", "1,1"], "distinct seeds"),
        (["--seeds", "one"], "comma-separated integers"),
        (["--config", "nowhere.toml"], "config file not found"),
    ],
)
def test_bad_arguments_fail_up_front(tmp_path: Path, capsys, argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--out", str(tmp_path / "out"), *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_a_microscopic_run_writes_results_and_plots(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = tmp_path / "tiny.toml"
    config.write_text(
        f'model.path = "{tiny_model_dir}"\n[train]\nlr = 1e-2\nwarmup_steps = 2\n'
        "[diloco]\nreplicas = 2\nsync_every = 5\nrounds = 2\n"
    )
    variants = (
        bench.Variant("dp", 2, 1, "fp32", "allreduce"),
        bench.Variant("diloco-h10", 2, 5, "fp32", "nesterov"),
    )
    budget = bench.Budget(steps=10, batch_size=2, seq_len=16, eval_every=5, eval_sequences=4, seeds=(0,))
    result = bench.run(load_config(config), budget, tmp_path / "out", variants)

    dp, diloco = result["runs"]
    assert [p["step"] for p in dp["curve"]] == [0, 5, 10] == [p["step"] for p in diloco["curve"]]
    assert dp["tokens"] == diloco["tokens"] == 10 * 2 * 2 * 16
    assert diloco["rounds"] == 2 and diloco["replicas_bit_identical"]
    assert dp["bytes_communicated"] == pytest.approx(5 * diloco["bytes_communicated"])  # H = 5 times more
    assert diloco["gap_vs_dp"] == pytest.approx(diloco["eval_loss"] / dp["eval_loss"] - 1)
    assert 32 < diloco["wire_bits"] < 33  # fp32 plus headers
    on_disk = json.loads((tmp_path / "out" / "results.json").read_text())
    assert set(on_disk) >= {"runs", "variants", "checks", "budget", "wall_s"}
    for png in ("eval_vs_tokens.png", "eval_vs_bytes.png"):
        assert (tmp_path / "out" / png).read_bytes()[:4] == b"\x89PNG"


def test_only_and_batch_size_select_what_runs(tmp_path: Path, capsys) -> None:
    args = bench.parse_args(["--out", str(tmp_path / "o"), "--only", "dp,diloco-h10", "--batch-size", "8"])
    assert [v.name for v in args.variants] == ["dp", "diloco-h10"]
    assert bench.budget_of(args).batch_size == 8 and bench.budget_of(args).steps == bench.FULL.steps
    for only, message in (("dp", "needs diloco-h10"), ("dp,h10", "unknown variant")):
        with pytest.raises(SystemExit):
            bench.parse_args(["--out", str(tmp_path / "o"), "--only", only])
        assert message in capsys.readouterr().err


def test_set_overrides_the_config(tmp_path: Path, capsys) -> None:
    args = bench.parse_args(
        ["--out", str(tmp_path / "o"), "--set", "diloco.outer_lr=0.7", "--set", "diloco.outer_momentum=0.3"]
    )
    assert (args.base.diloco.outer_lr, args.base.diloco.outer_momentum) == (0.7, 0.3)
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", str(tmp_path / "o"), "--set", "diloco.outer_lr=-1"])
    assert "diloco.outer_lr" in capsys.readouterr().err
