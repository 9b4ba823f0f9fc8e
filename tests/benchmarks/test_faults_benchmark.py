"""benchmarks/faults.py: the kill rule, the round and step accounting with hand-computed numbers, its
argument checks, and one microscopic faulty launch in which a replica is really killed and restarted."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_scripts import load_script

from composer_serverless.config import load_config

bench = load_script("faults")


def test_a_seeded_third_of_the_rounds_never_the_first_or_the_last() -> None:
    rounds = bench.kill_rounds(36, seed=0)
    assert len(rounds) == 12 and rounds == sorted(set(rounds))
    assert all(2 <= k <= 35 for k in rounds)
    assert bench.kill_rounds(36, seed=0) == rounds != bench.kill_rounds(36, seed=1)
    assert bench.kill_rounds(3, seed=0) == [2]  # the only round that is neither first nor last


def test_victims_rotate_over_the_ranks() -> None:
    assert bench.victim_order(0, 4) == [0, 1, 2, 3]
    assert bench.victim_order(5, 4) == [1, 2, 3, 0]


def test_accounting_by_hand() -> None:
    """Two replicas, H = 10, three rounds. Replica 1 is killed while uploading round 2 (10 steps it never
    recorded), comes back, trains round 3 too late to be averaged (10 steps wasted, but it takes the
    average), then jumps to the published round 4 (0 steps discarded) and contributes to round 5."""
    metrics = {
        0: [
            {"round": 0, "eval": {"eval/loss": 7.0}},
            {"round": 1, "steps": 10, "participants": [0, 1]},
            {"round": 2, "steps": 10, "participants": [0]},
            {"round": 3, "steps": 10, "participants": [0]},
            {"round": 4, "steps": 10, "participants": [0]},
            {"round": 5, "steps": 10, "participants": [0, 1]},
        ],
        1: [
            {"round": 1, "steps": 10, "participants": [0, 1]},
            {"round": 3, "steps": 10, "participants": [0]},
            {"round": 4, "steps": 0, "caught_up_from": 3},
            {"round": 5, "steps": 10, "participants": [0, 1]},
        ],
    }
    acc = bench.account(metrics, rounds=5, sync_every=10, unrecorded_steps=10)
    assert (acc.rounds, acc.committed, acc.commit_rate) == (5, 5, 1.0)
    # Useful: 10 x (2 + 1 + 1 + 1 + 2) = 70. Executed: 50 by replica 0, 30 by replica 1, 10 unrecorded.
    assert (acc.useful_steps, acc.executed_steps) == (70, 90)
    assert acc.goodput == pytest.approx(70 / 90)
    assert acc.participation(2) == pytest.approx(7 / 10)
    # A round nobody published does not count as committed.
    del metrics[0][3], metrics[1][1]
    assert bench.account(metrics, rounds=5, sync_every=10, unrecorded_steps=0).committed == 4


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rounds", "2"], "at least 3"),
        (["--seed", "-1"], ">= 0"),
        (["--config", "nowhere.toml"], "not found"),
    ],
)
def test_bad_arguments_fail_up_front(tmp_path: Path, capsys, argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--out", str(tmp_path / "out"), *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_a_killed_replica_is_restarted_and_accounted_for(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = tmp_path / "tiny.toml"
    config.write_text(
        f'model.path = "{tiny_model_dir}"\n[train]\nlr = 1e-2\nwarmup_steps = 2\n'
        "[diloco]\nreplicas = 2\nsync_every = 4\nrounds = 3\n[eval]\nsequences = 2\n"
    )
    budget = bench.Budget(rounds=3, seq_len=16, batch_size=2, replicas=2, min_replicas=1)
    out = tmp_path / "out"
    run = bench.run_once(bench.run_config(load_config(config), budget, 0, "faulty", out), out, [2])

    assert len(run["kills"]) == 1, f"the kill in round 2 was missed: {run['missed_kills']}"
    (kill,) = run["kills"]
    # The rule's first victim is rank 0, or rank 1 when rank 0 had already uploaded round 2 by the time the
    # killer looked (which of the two depends on the machine's timing).
    assert kill["round"] == 2 and kill["rank"] in (0, 1)
    assert (run["rounds"], run["committed"]) == (3, 3)
    assert run["unrecorded_steps"] == (0 if kill["recorded_round"] else 4)
    assert 0 < run["goodput"] <= 1 and run["executed_steps"] >= run["useful_steps"]
    assert run["replicas_bit_identical"]
