"""The report of a run evaluated by reward (no eval loss): headline figures, curves, and reward.png."""

import pytest

from composer_serverless.config import validate_config
from composer_serverless.launch import report
from composer_serverless.launch.report import eval_headline, plot_rewards, summarise, write_report
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import Reporter, read_metrics

CONFIG = validate_config(
    {
        "run_id": "report-test",
        "model": {"path": "unused"},
        "train": {"objective": "composer"},
        "diloco": {"replicas": 2, "sync_every": 2, "rounds": 2},
        "composer": {"data": {"prompts": "p", "heldout": "h"}, "rewards": [{"fn": "exact_match"}]},
    }
)


def _evaluation(first: float, add: float) -> dict:
    return {
        "eval/reward": (first + add) / 2,
        "eval/task/first/reward": first,
        "eval/task/add/reward": add,
        "eval/task/first/exact_match": first,
    }


def _row(rank: int, round_index: int, **extra) -> dict:
    train = {"grpo/loss": 0.01 * rank, "sdpo/loss": 0.2, "replay/loss": 0.6 - 0.1 * round_index}
    train["loss/total"] = sum(train.values())
    train["rollout/reward_mean"] = 0.1 * round_index
    row = {"train_loss": train["loss/total"], "train": train, "bytes_up": 10, "bytes_down": 20}
    return {**row, "round_s": 2.0, "blocked_s": 0.5, "global_sha256": f"digest-{round_index}", **extra}


@pytest.fixture
def run(tmp_path):
    store = ObjectStore(str(tmp_path / "report-test"))
    Reporter(store, 0).round(0, {"eval": _evaluation(0.0, 0.0)})
    for round_index in (1, 2):
        for rank in (0, 1):
            extra = {"eval": _evaluation(0.3 * round_index, 0.1)} if rank == 0 else {}
            Reporter(store, rank).round(round_index, _row(rank, round_index, **extra))
    return store


def test_a_reward_run_reports_reward_headlines_per_task_and_channel_curves(run):
    summary = summarise(run, CONFIG, wall_s=12.0)
    assert summary["initial_eval_loss"] is None and summary["final_eval_loss"] is None
    assert summary["initial_eval_reward"] == 0.0 and summary["final_eval_reward"] == pytest.approx(0.35)
    assert summary["eval_reward_by_round"] == {"0": 0.0, "1": pytest.approx(0.2), "2": pytest.approx(0.35)}
    assert summary["eval_reward_by_task"]["first"] == {"initial": 0.0, "final": 0.6, "best": 0.6}
    assert summary["eval_by_round"]["eval/task/first/exact_match"]["2"] == 0.6
    assert summary["train_by_round"]["grpo/loss"] == {"1": 0.005, "2": 0.005}  # mean over the two replicas
    assert summary["train_by_round"]["replay/loss"]["2"] == pytest.approx(0.4)
    assert summary["rounds_committed"] == 2 and summary["replicas_bit_identical"]


def test_the_reward_plot_is_written_next_to_the_summary(run):
    write_report(run, CONFIG, wall_s=12.0)
    png = run.get(layout.REWARD_PLOT)
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert run.exists("summary.json") and run.exists("loss.png")


def test_a_loss_run_gets_no_reward_plot(tmp_path):
    store = ObjectStore(str(tmp_path / "lm"))
    Reporter(store, 0).round(0, {"eval": {"eval/loss": 7.0}})
    Reporter(store, 0).round(1, {**_row(0, 1, eval={"eval/loss": 6.0})})
    summary = write_report(store, CONFIG, wall_s=1.0)
    assert (summary["initial_eval_loss"], summary["final_eval_loss"], summary["final_eval_reward"]) == (
        7.0,
        6.0,
        None,
    )
    assert not store.exists(layout.REWARD_PLOT)


def test_headlines_name_whatever_was_evaluated():
    assert eval_headline({"eval/loss": 6.5}) == "held-out loss of the global model 6.5000"
    assert (
        eval_headline(_evaluation(0.5, 0.25))
        == "held-out reward of the global model 0.375 (add 0.25, first 0.50)"
    )


def test_a_headline_names_the_rows_without_a_task_and_leaves_out_a_lone_group():
    """Rows without a task column value are evaluated as the group "default" (records.py): said as what it is
    beside other tasks, and left out alone, where its figure is the whole's."""
    both = {"eval/reward": 0.1, "eval/task/add/reward": 0.25, "eval/task/default/reward": -0.03}
    assert (
        eval_headline(both)
        == "held-out reward of the global model 0.100 (add 0.25, rows without a task -0.03)"
    )
    alone = {"eval/reward": -0.03, "eval/task/default/reward": -0.03}
    assert eval_headline(alone) == "held-out reward of the global model -0.030"
    one_task = {"eval/reward": 0.5, "eval/task/gsm8k/reward": 0.5}
    assert eval_headline(one_task) == "held-out reward of the global model 0.500"


def _legend(metrics, monkeypatch) -> list[str]:
    """The labels of the reward plot's legend (the figure taken where it would be rendered)."""
    figures = []
    monkeypatch.setattr(report, "_png", lambda fig: figures.append(fig) or b"")
    plot_rewards(metrics)
    return [text.get_text() for text in figures[0].axes[0].get_legend().get_texts()]


def test_the_reward_plot_draws_tasks_only_when_there_are_several(tmp_path, run, monkeypatch):
    assert _legend(read_metrics(run), monkeypatch) == [
        "held-out, all tasks",
        "held-out, add",
        "held-out, first",
        "rollouts (sampled)",
    ]
    store = ObjectStore(str(tmp_path / "one-group"))
    for round_index, value in ((0, 0.0), (1, 0.5)):
        evaluation = {"eval/reward": value, "eval/task/default/reward": value}
        Reporter(store, 0).round(
            round_index, _row(0, round_index, eval=evaluation) if round_index else {"eval": evaluation}
        )
    assert _legend(read_metrics(store), monkeypatch) == ["held-out, all tasks", "rollouts (sampled)"]
