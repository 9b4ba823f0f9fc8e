"""A short composer run through the real launcher and subprocess replicas: every channel contributes."""

import io

import pytest
from rich.console import Console
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from composer_serverless.config import validate_config
from composer_serverless.data.task_suite import TASKS as TASK_SUITE
from composer_serverless.launch.launcher import launch
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import read_metrics
from tests.composer_tasks import TINY_CHARS, composer
from tests.conftest import cli_in_fresh_process

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("composer")
    config = validate_config(
        {
            "run_id": "composer-e2e",
            "store": str(tmp_path),
            "model": {"tiny": TINY_CHARS},
            "train": {"objective": "composer", "lr": 1e-3},
            "diloco": {"replicas": 2, "sync_every": 2, "rounds": 2},
            "eval": {"sequences": 14},
            "composer": composer(group_size=4, prompts_per_step=4, max_new_tokens=4, pairs_per_step=4),
            "executor": {"type": "local", "threads_per_replica": 1},
            "tracking": {"report_to": ["tensorboard"], "dir": str(tmp_path / "tracking")},
        }
    )
    summary = launch(config, "composer-e2e", Console(file=io.StringIO()))
    return ObjectStore(str(tmp_path / "composer-e2e")), summary


def test_two_replicas_two_rounds_with_all_three_channels(finished_run):
    run, summary = finished_run
    assert summary["rounds_committed"] == 2 and summary["replicas_bit_identical"]
    metrics = read_metrics(run)
    assert sorted(metrics) == [0, 1]
    for rank, rows in metrics.items():
        trained = [r for r in rows if r["round"] > 0]
        assert [r["round"] for r in trained] == [1, 2]
        for row in trained:
            train = row["train"]
            assert train["grpo/loss"] != 0, (rank, row["round"])
            assert train["rollout/frac_zero_std"] < 1
            assert train["sdpo/loss"] > 0 and train["sdpo/tokens"] > 0
            assert train["replay/loss"] > 0 and train["replay/pairs"] == 4
            assert train["loss/total"] == pytest.approx(row["train_loss"], rel=1e-5)
    evals = [r["eval"] for r in metrics[0] if "eval" in r]
    assert len(evals) == 3 and all("eval/task/digit/reward" in e for e in evals)
    assert summary["initial_eval_reward"] is not None
    assert set(summary["eval_reward_by_task"]) == {task.name for task in TASK_SUITE}
    assert run.get(layout.REWARD_PLOT).startswith(b"\x89PNG")
    assert run.exists("final/config.json")


def test_the_tracker_has_the_rewards_per_step_and_a_completions_table_per_round(finished_run):
    run, _ = finished_run
    events = EventAccumulator(str(run.local_dir(layout.TRACKING_TENSORBOARD)), size_guidance={"scalars": 0})
    events.Reload()
    for key in (
        "rollout/reward_mean",
        "rollout/reward_std",
        "grpo/clip_ratio/region",
        "rollout/completion_len",
        "rollout/tokens_per_s",
        "time/generate_s",
        "train/grad_norm",
    ):
        assert [e.step for e in events.Scalars(key)] == [1, 2, 3, 4], key
    assert all(e.value > 0 for e in events.Scalars("time/generate_s"))
    tables = events.Tensors("completions")
    assert [t.step for t in tables] == [2, 4]  # each round's, at its last step
    metrics = read_metrics(run)
    for table, k in zip(tables, (1, 2), strict=True):
        lines = table.tensor_proto.string_val[0].decode().splitlines()
        assert lines[0] == "| round | replica | prompt | completion | reward |"
        # Each replica's round row holds its sample: one completion of each prompt it drew (4 a step, 2 steps:
        # the 8 of tracking.completions_per_round), with its reward and each reward's own value.
        kept = [c for rank in (0, 1) for r in metrics[rank] if r["round"] == k for c in r["completions"]]
        assert len(kept) == 2 * 8 and len(lines) == 2 + len(kept)
        assert all(isinstance(c["reward"], float) and "reward/exact_match" in c for c in kept)


def test_status_of_the_finished_run_names_its_reward_without_the_training_stack(finished_run):
    run, summary = finished_run
    result, loaded = cli_in_fresh_process("status", run.url)
    assert result.returncode == 0, result.stdout + result.stderr
    # Each replica's figure is its rollout reward at its last step, carried by its final ("done") heartbeat.
    header = next(line for line in result.stdout.splitlines() if "rank" in line)
    assert [c.strip() for c in header.strip("┃").split("┃")][:6] == [
        "rank",
        "state",
        "attempt",
        "round",
        "step",
        "reward",
    ]
    for rank, rows in read_metrics(run).items():
        last = max(rows, key=lambda row: row["round"])["step_rows"][-1]["rollout/reward_mean"]
        line = next(line for line in result.stdout.splitlines() if line.startswith(f"│ {rank} "))
        assert [c.strip() for c in line.strip("│").split("│")][5] == f"{last:.4f}", line
    initial, final = summary["initial_eval_reward"], summary["final_eval_reward"]
    assert f"finished: held-out reward of the global model: {initial:.4f} -> {final:.4f}" in result.stdout
    assert summary["final_eval_loss"] is None and "held-out loss" not in result.stdout
    assert loaded == []


def test_a_replica_of_two_ranks_runs_every_channel_through_the_launcher(tmp_path):
    """ranks_per_replica = 2: the worker starts two FSDP ranks over gloo, which sample their shares from the
    gathered weights, train, evaluate together and sync through the store, every round."""
    config = validate_config(
        {
            "run_id": "composer-g2",
            "store": str(tmp_path),
            "model": {"tiny": TINY_CHARS},
            "train": {"objective": "composer", "lr": 1e-3, "micro_batch_size": 4},
            "diloco": {"replicas": 1, "min_replicas": 1, "sync_every": 2, "rounds": 2},
            "eval": {"sequences": 4},
            "composer": composer(group_size=4, prompts_per_step=4, max_new_tokens=4, pairs_per_step=4),
            "executor": {"type": "local", "threads_per_replica": 1, "ranks_per_replica": 2},
        }
    )
    summary = launch(config, "composer-g2", Console(file=io.StringIO()))
    assert summary["rounds_committed"] == 2, summary
    trained = [r for r in read_metrics(ObjectStore(str(tmp_path / "composer-g2")))[0] if r["round"] > 0]
    assert [r["round"] for r in trained] == [1, 2]
    for row in trained:
        train = row["train"]
        assert train["sdpo/loss"] > 0 and train["replay/loss"] > 0 and train["replay/pairs"] == 4
        assert train["rollout/tokens"] > 0
    assert summary["final_eval_reward"] is not None
