"""benchmarks/goodput.py: the preemption schedule, the accounting of lock-step rounds and of decoupled
versions with hand-computed numbers, the time to a token count, the loss at equal tokens, the scoring of
decoupled versions, lifetimes, the configs it launches and its argument checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_scripts import load_script

from composer_serverless.accelerator.simulated import simulated
from composer_serverless.config import load_config
from composer_serverless.models.loading import load_pretrained
from composer_serverless.rendezvous import decoupled as store_versions
from composer_serverless.rendezvous.decoupled import Contribution, Version
from composer_serverless.rendezvous.telemetry import Reporter
from composer_serverless.replicas.trainer import Replica
from tests.rendezvous.harness import create, make_config

bench = load_script("goodput")


def test_preemptions_are_a_seeded_poisson_process_per_learner() -> None:
    kills = bench.kill_times(seed=0, learners=4, mtbi_s=10.0, horizon_s=1000.0)
    assert kills == sorted(kills) and all(0 <= t < 1000 for t, _ in kills)
    per_rank = [sum(1 for _, r in kills if r == rank) for rank in range(4)]
    assert all(60 <= n <= 140 for n in per_rank)  # mean 100 each: far outside this is not a rate of 1/10 s
    assert bench.kill_times(0, 4, 10.0, 1000.0) == kills != bench.kill_times(1, 4, 10.0, 1000.0)
    assert bench.kill_times(0, 4, 10.0, 0.0) == []


def _steps(seconds: list[float], sync: float = 0.0, tokens: float = 100.0) -> list[dict]:
    return [
        {"time_s": {"step": s, "sync": sync if i == len(seconds) - 1 else 0.0}, "tokens": tokens}
        for i, s in enumerate(seconds)
    ]


def test_lock_step_accounting_by_hand() -> None:
    """Two learners, H = 2. Round 1: both merged. Round 2: learner 1 arrived late (its 2 steps wasted).
    Step rows hold each step's time, the last one 0.5 s of it blocked in the sync."""
    metrics = {
        0: [
            {"round": 0, "eval": {"eval/loss": 7.0}},
            {
                "round": 1,
                "steps": 2,
                "participants": [0, 1],
                "time": 110.0,
                "step_rows": _steps([1.0, 1.5], 0.5),
            },
            {
                "round": 2,
                "steps": 2,
                "participants": [0],
                "time": 120.0,
                "step_rows": _steps([1.0, 1.5], 0.5),
            },
        ],
        1: [
            {
                "round": 1,
                "steps": 2,
                "participants": [0, 1],
                "time": 111.0,
                "step_rows": _steps([2.0, 2.5], 0.5),
            },
            {
                "round": 2,
                "steps": 2,
                "participants": [0],
                "time": 125.0,
                "step_rows": _steps([2.0, 2.0], 0.5),
            },
        ],
    }
    acc = bench.account_lock_step(metrics)
    # merged: round 1 both (1 + 1 + 2 + 2 = 6 s of steps), round 2 learner 0 only (1 + 1 = 2 s)
    assert acc.useful_s == 8.0
    assert (acc.executed_steps, acc.merged_steps) == (8, 6)
    assert acc.merges == [(111.0, 400.0), (120.0, 200.0)]
    assert acc.eval_time == {1: 111.0, 2: 120.0}
    assert dict(acc.staleness) == {0: 3}
    assert bench.time_to_tokens(acc.merges, 500.0, start=100.0) == (20.0, 2)
    assert bench.time_to_tokens(acc.merges, 400.0, start=100.0) == (11.0, 1)
    assert bench.time_to_tokens(acc.merges, 601.0, start=100.0) is None


def test_decoupled_accounting_by_hand() -> None:
    """Two learners, H = 2, 100 tokens a step. Version 1 merged (0, 0) and (1, 0), both from version 0;
    version 2 merged (1, 1), from version 0 (one version behind), and dropped (0, 1). Learner 1 sent (1, 0)
    and (1, 1) with no row between them: its only row names (1, 1), so (1, 0) is timed at its mean recorded
    step time. Learner 0's row names (0, 0) and holds 0.5 s of a sync in its last step."""
    metrics = {
        0: [{"round": 1, "contribution": 0, "steps": 2, "time": 5.0, "step_rows": _steps([1.0, 1.5], 0.5)}],
        1: [{"round": 2, "contribution": 1, "steps": 2, "time": 9.0, "step_rows": _steps([2.0, 3.0])}],
    }
    contributions = {
        (0, 0): Contribution(0, 0, base=0, tokens=200, steps=2),
        (1, 0): Contribution(1, 0, base=0, tokens=200, steps=2),
        (1, 1): Contribution(1, 1, base=0, tokens=200, steps=2),
        (0, 1): Contribution(0, 1, base=1, tokens=200, steps=2),
    }
    versions = [
        Version(2, "w", {0: 2, 1: 2}, [[1, 1]], [{"learner": 0, "seq": 1, "why": "an outlier"}]),
        Version(0, "w"),
        Version(1, "w", {0: 1, 1: 1}, [[0, 0], [1, 0]]),
    ]
    acc = bench.account_decoupled(metrics, versions, contributions, {0: 100.0, 1: 104.0, 2: 108.0})
    # (0, 0): 1 + 1 = 2 s; (1, 1): 2 + 3 = 5 s; (1, 0): 2 steps x 5 s / 2 steps = 5 s (estimated)
    assert acc.useful_s == 12.0 and acc.estimated == 1
    assert (acc.executed_steps, acc.merged_steps) == (8, 6)  # (0, 1) ran and was dropped
    assert acc.merges == [(104.0, 400.0), (108.0, 200.0)]
    assert acc.eval_time == {1: 104.0, 2: 108.0} and acc.tokens_at == {1: 400.0, 2: 600.0}
    assert dict(acc.staleness) == {0: 2, 1: 1}
    assert bench.time_to_tokens(acc.merges, 500.0, start=100.0) == (8.0, 2)
    # the loss at 400 tokens is that of the first evaluated global holding as many
    assert bench.loss_at_tokens(acc.tokens_at, {2: 5.5}, 400.0) == (5.5, 600.0)
    assert bench.loss_at_tokens(acc.tokens_at, {1: 6.0, 2: 5.5}, 400.0) == (6.0, 400.0)
    assert bench.loss_at_tokens(acc.tokens_at, {2: 5.5}, 601.0) is None


def test_at_equal_tokens_by_hand() -> None:
    """Lock-step ends at round 3 with 1200 tokens, loss 4.5, 30 s after the launch. Decoupled's first version
    holding 1200 tokens is version 4 (1250 tokens, loss 4.6: 2.2 % worse); its first version scoring at most
    4.5 is version 5 (1500 tokens, 4.4) at 18 s, 0.6 of lock-step's 30 s; version 3, the last one below 1200
    tokens, and a later better one (version 6) are not the ones taken."""
    lock_step = [[1, 400.0, 10.0, 6.0], [2, 800.0, 20.0, 5.0], [3, 1200.0, 30.0, 4.5]]
    decoupled = [
        [1, 300.0, 5.0, 6.2],
        [2, 700.0, 9.0, 5.6],
        [3, 1100.0, 12.0, 4.9],
        [4, 1250.0, 15.0, 4.6],
        [5, 1500.0, 18.0, 4.4],
        [6, 1800.0, 21.0, 4.3],
    ]
    compared = bench.at_equal_tokens(lock_step, decoupled)
    assert compared["relative_gap"] == pytest.approx(4.6 / 4.5 - 1)
    assert compared == {
        "tokens": 1200.0,
        "lock-step": {"round": 3, "tokens": 1200.0, "s": 30.0, "loss": 4.5},
        "decoupled": {"version": 4, "tokens": 1250.0, "s": 15.0, "loss": 4.6},
        "relative_gap": compared["relative_gap"],
        "to_lock_step_final_loss": {
            "version": 5,
            "tokens": 1500.0,
            "s": 18.0,
            "loss": 4.4,
            "lock_step_s": 30.0,
            "ratio": 0.6,
        },
        "finals": {
            "lock-step": {"round": 3, "tokens": 1200.0, "loss": 4.5},
            "decoupled": {"version": 6, "tokens": 1800.0, "loss": 4.3},
            "relative_gap": compared["finals"]["relative_gap"],
        },
    }
    assert compared["finals"]["relative_gap"] == pytest.approx(4.3 / 4.5 - 1)


def test_at_equal_tokens_when_decoupled_reaches_neither() -> None:
    """A decoupled run that merged fewer tokens than lock-step and never scored as low: both are None."""
    compared = bench.at_equal_tokens([[1, 400.0, 10.0, 5.0]], [[1, 200.0, 4.0, 6.0], [2, 390.0, 8.0, 5.1]])
    assert compared["lock-step"] == {"round": 1, "tokens": 400.0, "s": 10.0, "loss": 5.0}
    assert compared["decoupled"] is compared["relative_gap"] is compared["to_lock_step_final_loss"] is None
    # its final global, with 390 of lock-step's 400 tokens: 2 % worse
    assert compared["finals"]["decoupled"] == {"version": 2, "tokens": 390.0, "loss": 5.1}
    assert compared["finals"]["relative_gap"] == pytest.approx(0.02)


def test_lifetimes_sum_every_process_of_a_learner() -> None:
    lives = {11: (0, 100.0, 130.0), 12: (1, 100.0, 110.0), 13: (1, 118.0, 130.0), 14: (1, 131.0, 130.95)}
    assert bench.lifetimes_s(lives) == {0: 30.0, 1: 22.0}


def test_alive_time_breakdown_by_hand() -> None:
    """Learner 0: one life 100-130, rounds 105-112 and 112-120 (steps 6 s and 7 s), then 10 s of tail.
    Learner 1: killed at 115 (its round 104-110 had 5 s of steps; 5 s in flight after it), restarted at 116,
    held 8 s, round 126-129 (2 s of steps), exit at 131. Useful: 15 of the 20 s of steps recorded."""
    lives = {11: (0, 100.0, 130.0), 12: (1, 100.0, 115.0), 13: (1, 116.0, 131.0)}
    metrics = {
        0: [
            {"round": 0, "time": 104.0, "eval": {"eval/loss": 7.0}},  # learner 0's initial evaluation
            {"round": 1, "time": 112.0, "round_s": 7.0, "step_rows": _steps([6.0])},
            {"round": 2, "time": 120.0, "round_s": 8.0, "step_rows": _steps([7.0])},
        ],
        1: [
            {"round": 1, "time": 110.0, "round_s": 6.0, "step_rows": _steps([5.0])},
            {"round": 2, "time": 129.0, "round_s": 3.0, "step_rows": _steps([2.0])},
        ],
    }
    got = bench.alive_breakdown(lives, {13: 8.0}, {12}, metrics, useful_s=15.0)
    # alive 30 + 15 + 15 = 60; start-up 5 + 4 + 2 = 11; cold 8; in flight 5; unmerged 20 - 15 = 5
    assert got == {
        "cold_start": 8.0,
        "start_up": 11.0,
        "useful": 15.0,
        "unmerged": 5.0,
        "in_flight_at_kill": 5.0,
        "other": 16.0,
    }


def test_the_configs_it_launches() -> None:
    base = load_config("deploy/configs/local-demo.toml")
    sizes = bench.Sizes(rounds=3, sync_every=4, batch_size=2, eval_sequences=8)
    config = bench.run_config(base, sizes, "lock-step", 1, "run", Path("/tmp/goodput-test"))
    assert (config.diloco.replicas, config.diloco.rounds, config.diloco.sync_every) == (4, 3, 4)
    assert (config.data.batch_size, config.eval.sequences, config.eval.every_rounds) == (2, 8, 1)
    assert config.store == "file:///tmp/goodput-test/runs" and config.seed == 1
    decoupled = bench.run_config(base, sizes, "decoupled", 1, "run", Path("/tmp/goodput-test"))
    dc = decoupled.diloco.decoupled
    assert decoupled.diloco.mode == "decoupled" and decoupled.diloco.rounds == 3 * 4 // 2
    # a quorum below N, the adaptive grace window with the product's default bound (none); learners never wait
    assert (dc.min_quorum, dc.grace_s, dc.grace_gamma, dc.max_lag) == (2, None, 0.5, 1)
    assert dc.keep_versions is None  # every version and contribution stays for the accounting
    # both sides with the demo's embedding rule (a row combined over the learners whose data held its token)
    assert config.diloco.embedding_average == decoupled.diloco.embedding_average == "touched"
    lock_step_all = bench.run_config(
        base,
        sizes,
        "lock-step",
        1,
        "run",
        Path("/tmp/goodput-test"),
        overrides=("diloco.embedding_average=all",),
    )
    assert lock_step_all.diloco.embedding_average == "all"
    waiting = bench.run_config(base, sizes, "decoupled", 1, "run", Path("/tmp/goodput-test"), max_lag=0)
    assert waiting.diloco.decoupled.max_lag == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--scenarios", "ae"], "--scenarios takes letters of abcd"),
        (["--modes", "async"], "--modes takes lock-step, decoupled"),
        (["--rounds", "0"], "must be >= 1"),
        (["--max-lag", "-1"], "--max-lag, --cold-start-s >= 0"),
        (["--cold-start-s", "-1"], "--max-lag, --cold-start-s >= 0"),
        (["--mtbi-s", "0"], "--mtbi-s > 0"),
        (["--set", "diloco.decoupled.outer"], "expected dotted.key=value"),
        (["--set", "diloco.decoupled.outer=adam"], "diloco.decoupled.outer"),
        (["--set", "diloco.decoupled.adopt_whenn=arrival"], "did you mean diloco.decoupled.adopt_when?"),
        (["--set", "diloco.decoupled.max_age=0"], "must be at least max_lag"),
    ],
)
def test_bad_arguments_exit_2(
    tmp_path: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(["--out", str(tmp_path / "out"), *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_set_overrides_the_decoupled_side_only(tmp_path: Path) -> None:
    args = bench.parse_args(
        [
            "--out",
            str(tmp_path / "out"),
            "--set",
            "diloco.decoupled.outer=delayed_nesterov",
            "--set",
            "diloco.decoupled.adopt = 'overwrite'",
            "--set",
            "diloco.decoupled.discount=1.0",
        ]
    )
    assert args.set == [
        "diloco.decoupled.outer=delayed_nesterov",
        "diloco.decoupled.adopt = 'overwrite'",
        "diloco.decoupled.discount=1.0",
    ]
    base = load_config("deploy/configs/local-demo.toml")
    overrides = tuple(args.set)
    dc = bench.run_config(base, args.sizes, "decoupled", 0, "run", tmp_path, overrides=overrides).diloco
    assert (dc.decoupled.outer, dc.decoupled.adopt, dc.decoupled.discount) == (
        "delayed_nesterov",
        "overwrite",
        1.0,
    )
    assert dc.decoupled.min_quorum == 2  # the benchmark's own settings stay, but those set
    # applied last, over the benchmark's own
    lag = bench.run_config(
        base, args.sizes, "decoupled", 0, "run", tmp_path, overrides=("diloco.decoupled.max_lag=2",)
    )
    assert lag.diloco.decoupled.max_lag == 2


def test_versions_are_scored_as_a_replica_scores_a_round(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Two hand-made versions in a run's store (the initial weights plus 0.01, and times 0.9): the benchmark
    scores each as a replica of the run scores that global in a round (its own evaluation, on the simulated
    accelerator), and version 0 not at all."""
    config = make_config(str(tmp_path / "runs"), "scored", tiny_model_dir)
    run = create(config)
    with simulated():
        model, tokenizer = load_pretrained(tiny_model_dir, "float32")
        replica = Replica(run, config, 0, Reporter(run, 0), model.to("cuda"), tokenizer)
        initial = {name: p.detach().to("cpu", copy=True) for name, p in replica.model.named_parameters()}
        globals_ = {1: {n: t + 0.01 for n, t in initial.items()}, 2: {n: t * 0.9 for n, t in initial.items()}}
        records = [Version(v, "hand-made") for v in range(3)]
        for record in records:
            assert store_versions.commit(run, record, globals_.get(record.version, initial), None, None)
        by_replica = {v: replica._evaluate(v, [0], params)["eval/loss"] for v, params in globals_.items()}
    scored = bench.score_versions(run, config, records)
    assert scored == pytest.approx(by_replica, rel=1e-6) and set(scored) == {1, 2}
    assert abs(scored[1] - scored[2]) > 1e-3  # each version's own parameters were scored


def test_the_table_compares_each_decoupled_run_with_its_seeds_lock_step(tmp_path: Path) -> None:
    """Runs made apart (benchmarks/goodput_table.py): lock-step of seed 0 ends at 1200 tokens, loss 4.5; the
    decoupled run of seed 0 first holds 1200 tokens at version 2, loss 4.59 (+2 %); the decoupled run of seed 1
    has no lock-step run to compare with and is left out."""
    table = load_script("goodput_table")
    scenario = "a: no faults, equal speeds"

    def write(name: str, seed: int, mode: str, evals: list[list[float]], **decoupled: object) -> None:
        row = {"goodput": 0.5, "evals": evals, "staleness": {"1": 3}, "merged_steps": 8, "executed_steps": 9}
        result = {"seed": seed, "decoupled": {"max_lag": 1, **decoupled}, "results": {scenario: {mode: row}}}
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(result))

    write("lock-step-s0", 0, "lock-step", [[1, 600.0, 10.0, 5.0], [2, 1200.0, 20.0, 4.5]])
    write("keep-s0", 0, "decoupled", [[1, 700.0, 5.0, 4.8], [2, 1300.0, 9.0, 4.59]], set=["x=1"])
    write("keep-s1", 1, "decoupled", [[1, 1300.0, 9.0, 4.0]])
    rows = table.table(tmp_path)
    assert len(rows) == 1
    row = rows[0]
    assert (row["run"], row["scenario"], row["seed"], row["set"]) == ("keep-s0", "a", 0, ["x=1"])
    assert row["at_equal_tokens"]["decoupled"]["version"] == 2
    assert row["at_equal_tokens"]["relative_gap"] == pytest.approx(0.02)
    assert row["staleness"] == {"1": 3} and row["goodput"] == row["lock_step_goodput"] == 0.5
    # Lock-step's full run (1200 tokens) holds fewer tokens than decoupled's final (1300): compared there too,
    # both schedules complete; +2 %.
    assert row["complete_schedules"]["lock-step"] == {"rounds": 2, "tokens": 1200.0, "loss": 4.5}
    assert row["complete_schedules"]["relative_gap"] == pytest.approx(0.02)


def test_a_decoupled_run_is_compared_with_the_longest_lock_step_run_holding_no_more_tokens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Lock-step runs of 2 and 3 rounds for one seed (600 tokens a round): the decoupled run's final at 1500
    tokens, loss 4.41, is compared with the 2-round run's final (1200 tokens, 4.5: -2 %), not with the
    3-round run's (1800 tokens), which is the one compared at equal tokens (not reached there)."""
    table = load_script("goodput_table")
    scenario = "a: no faults, equal speeds"
    for name, mode, evals in [
        ("ls2", "lock-step", [[1, 600.0, 10.0, 5.0], [2, 1200.0, 20.0, 4.5]]),
        ("ls3", "lock-step", [[1, 600.0, 10.0, 5.0], [2, 1200.0, 20.0, 4.7], [3, 1800.0, 30.0, 4.2]]),
        ("dec", "decoupled", [[1, 800.0, 9.0, 4.9], [2, 1500.0, 18.0, 4.41]]),
    ]:
        row = {"goodput": 0.5, "evals": evals, "staleness": {}, "merged_steps": 8, "executed_steps": 9}
        result = {"seed": 0, "decoupled": {"max_lag": 1}, "results": {scenario: {mode: row}}}
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(result))
    (row,) = table.table(tmp_path)
    assert row["at_equal_tokens"]["lock-step"]["round"] == 3 and row["at_equal_tokens"]["decoupled"] is None
    complete = row["complete_schedules"]
    assert complete["lock-step"] == {"rounds": 2, "tokens": 1200.0, "loss": 4.5}
    assert complete["decoupled"] == {"version": 2, "tokens": 1500.0, "loss": 4.41}
    assert complete["relative_gap"] == pytest.approx(-0.02)
    assert table.main([str(tmp_path)]) == 0
    assert "| 2, 0.001M / 0.002M (-2.0 %) |" in capsys.readouterr().out
