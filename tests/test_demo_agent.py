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
DATA = CONFIGS.parent / "data" / "agent-safe"


def test_the_warm_starts_traces_show_the_environments_own_tool_schema_and_train_only_the_model_turns():
    from composer_serverless.data.chat import render_chat
    from composer_serverless.environments.tools import EnvironmentFactory
    from composer_serverless.models.loading import char_tokenizer

    tools = EnvironmentFactory.load((), "agent_safe.py:Safe", CONFIGS)().tools
    tokenizer = char_tokenizer(None, "qwen2.5")
    trace = json.loads((DATA / "traces.jsonl").read_text().splitlines()[0])
    assert trace["tools"] == tools
    ids, mask = render_chat(tokenizer, trace["messages"], trace["tools"])
    code = trace["messages"][2]["content"]
    trained = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
    call = '<tool_call>\n{"name": "read_note", "arguments": {}}\n</tool_call>'
    assert trained == f"{call}<|im_end|>\n{code}<|im_end|>\n"


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
