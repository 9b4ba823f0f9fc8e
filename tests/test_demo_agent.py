"""`make demo-agent`, shortened: its two configs as the Makefile runs them (the warm start on traces, then RL on
episodes from that run's final model), one round each on the simulated accelerator. It checks that both runs
end, that the RL run reports its held-out success (eval/reward before and after), and that the replicas end
bit-identical; the learning itself is measured by the full demo (RESULTS.md), not here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from composer_serverless.cli import run as cli_run
from tests.conftest import ran_on_the_simulated_accelerator, replicas_on_the_simulated_accelerator

CONFIGS = Path(__file__).resolve().parents[1] / "deploy" / "configs"


@pytest.mark.slow
def test_the_agent_demo_shortened_warm_starts_trains_episodes_and_keeps_the_replicas_identical(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    short = ["--set", "diloco.rounds=1", "--set", "diloco.sync_every=2", "--set", "eval.sequences=4"]
    with replicas_on_the_simulated_accelerator():
        warm = ["launch", str(CONFIGS / "local-agent-warmup.toml"), "--set", "run_id=warm", *short]
        assert cli_run(warm) == 0
        rl = ["launch", str(CONFIGS / "local-agent.toml"), "--set", "run_id=agent", *short]
        assert (
            cli_run(
                [*rl, "--set", "model.path=runs/warm/final", "--set", "composer.rollout.prompts_per_step=1"]
            )
            == 0
        )
    for run_id in ("warm", "agent"):
        summary = json.loads((tmp_path / "runs" / run_id / "summary.json").read_text())
        assert summary["rounds_committed"] == 1 and summary["replicas_bit_identical"], run_id
        assert ran_on_the_simulated_accelerator(tmp_path / "runs" / run_id / "logs")
    summary = json.loads((tmp_path / "runs" / "agent" / "summary.json").read_text())
    assert 0.0 <= summary["initial_eval_reward"] <= 1.0 and 0.0 <= summary["final_eval_reward"] <= 1.0
    rows = [
        json.loads(p.read_text())
        for p in sorted((tmp_path / "runs" / "agent" / "metrics" / "0").glob("*.json"))
    ]
    trained = [r["train"] for r in rows if r["round"] > 0]
    assert trained and all(t["rollout/turns"] >= 1 for t in trained)
