"""A composer run written as a TRL user writes it, through the real launcher and subprocess replicas on the
simulated accelerator: a weight-0 reward as an evaluation metric, a sampled held-out evaluation with pass@k
shared between two replicas, and ``report_to`` as a string."""

import io

import pytest
from rich.console import Console
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from composer_serverless.config import validate_config
from composer_serverless.launch.launcher import launch
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import read_metrics
from tests.composer_tasks import TINY_CHARS, composer
from tests.conftest import ran_on_the_simulated_accelerator, replicas_on_the_simulated_accelerator

pytestmark = pytest.mark.slow


def test_a_metric_of_weight_0_and_pass_at_k_reach_the_rows_and_the_tracker(tmp_path):
    table = composer(group_size=4, prompts_per_step=4, max_new_tokens=4, pairs_per_step=4)
    table["rewards"] = [{"fn": "format", "pattern": ".*[0-9].*"}, {"fn": "exact_match", "weight": 0}]
    config = validate_config(
        {
            "run_id": "trl-e2e",
            "store": str(tmp_path),
            "model": {"tiny": TINY_CHARS},
            "train": {"objective": "composer", "lr": 1e-3},
            "diloco": {"replicas": 2, "sync_every": 2, "rounds": 1},
            "eval": {"sequences": 14, "temperature": 1.0, "samples": 4, "pass_at": [1, 4]},
            "composer": table,
            "executor": {"type": "local", "threads_per_replica": 1},
            "tracking": {"report_to": "tensorboard", "dir": str(tmp_path / "tracking")},
        }
    )
    assert config.tracking.report_to == ("tensorboard",)
    with replicas_on_the_simulated_accelerator():
        summary = launch(config, "trl-e2e", Console(file=io.StringIO()))
    run = ObjectStore(str(tmp_path / "trl-e2e"))
    assert summary["rounds_committed"] == 1
    assert ran_on_the_simulated_accelerator(run.local_dir("logs"))
    metrics = read_metrics(run)
    (trained,) = [r for r in metrics[0] if r["round"] == 1]
    assert "rollout/reward/exact_match" in trained["train"]  # the metric is logged every step
    evals = [r["eval"] for r in metrics[0] if "eval" in r]
    assert len(evals) == 2  # before training, and after round 1: each the two replicas' shares combined
    for evaluation in evals:
        assert 0 <= evaluation["eval/pass@1"] <= evaluation["eval/pass@4"] <= 1
        # The weighted sum is format's alone: exact_match, at weight 0, adds nothing to it.
        assert evaluation["eval/reward"] == pytest.approx(evaluation["eval/format"])
        assert evaluation["eval/pass@4"] == evaluation["eval/format/pass@4"]
        assert {"eval/exact_match", "eval/exact_match/pass@4", "eval/task/digit/pass@1"} <= evaluation.keys()
    events = EventAccumulator(str(run.local_dir(layout.TRACKING_TENSORBOARD)), size_guidance={"scalars": 0})
    events.Reload()
    assert {"eval/pass@4", "eval/exact_match/pass@4", "rollout/reward/exact_match"} <= set(
        events.Tags()["scalars"]
    )
