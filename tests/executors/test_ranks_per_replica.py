"""Replicas of several ranks in the plans: every backend says how many processes shard each replica, every GPU
that is paid for is a rank, and local replicas are pinned to GPUs of their own."""

from __future__ import annotations

from typing import Any

import pytest

from composer_serverless.config import ConfigError, load_config, validate_config
from composer_serverless.executors import make_executor
from composer_serverless.executors.local import gpu_assignment, visible_gpus
from composer_serverless.rendezvous.store import ObjectStore
from tests.executors.conftest import REPO


def _config(executor: dict[str, Any], **top: Any) -> Any:
    return validate_config(
        {
            "run_id": "ranks",
            "store": "s3://bucket/runs",
            "model": {"tiny": {}},
            "data": {"batch_size": 8},
            "diloco": {"replicas": 2, "sync_every": 2, "rounds": 2},
            "executor": executor,
            **top,
        }
    )


@pytest.mark.parametrize(
    ("executor", "ranks", "gpus"),
    [
        ({"type": "local", "ranks_per_replica": 2}, 2, 0),
        ({"type": "modal", "gpu": "H100", "gpu_count": 4}, 4, 4),
        ({"type": "hf_jobs", "flavor": "a100x8"}, 8, 8),
        ({"type": "hf_jobs", "flavor": "a10g-largex2"}, 2, 2),
        ({"type": "hf_jobs", "flavor": "cpu-upgrade"}, 1, 0),
        ({"type": "modal"}, 1, 1),
    ],
)
def test_the_plan_of_every_backend_shows_the_ranks_of_a_replica(
    executor: dict[str, Any], ranks: int, gpus: int, tmp_path, monkeypatch
) -> None:
    """Every GPU billed is a rank (a CPU flavor runs one CPU rank)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the local plan on any machine: CPU ranks
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):  # (another test's loopback S3 server)
        monkeypatch.delenv(name, raising=False)
    config = _config(executor)
    if executor["type"] == "local":
        config = config.model_copy(update={"store": str(tmp_path)})
    plan = make_executor(config, ObjectStore(str(tmp_path))).plan(config, str(tmp_path))
    assert plan.ranks_per_replica == ranks == config.ranks_per_replica
    assert len(plan.replicas) == 2  # replicas, each of `ranks` processes
    assert plan.cost.gpus_per_replica == gpus


def test_gpus_that_would_sit_idle_cannot_be_planned() -> None:
    """A composer run on several GPUs per replica needs shares that split evenly over them and nothing that
    would make one rank pass through the model more often than another; a batch must split evenly too. Each
    refusal names the setting and the fix before anything is billed."""
    composer = REPO / "deploy" / "configs" / "local-composer.toml"
    off = ["composer.rollout.dynamic_sampling=false"]
    with pytest.raises(ConfigError, match=r"dynamic_sampling is not supported with 2 ranks.*gpu_count"):
        load_config(composer, ["store=s3://bucket/runs", "executor.gpu_count=2"], "modal")
    assert load_config(composer, ["executor.ranks_per_replica=2", *off]).ranks_per_replica == 2
    with pytest.raises(ConfigError, match=r"prompts_per_step \(8\) must be a multiple of the 3 ranks"):
        load_config(composer, ["executor.ranks_per_replica=3", *off])
    with pytest.raises(ConfigError, match=r"pairs_per_step \(6\) must be a multiple of the 4 ranks"):
        load_config(composer, ["executor.ranks_per_replica=4", "composer.replay.pairs_per_step=6", *off])
    with pytest.raises(ConfigError, match=r"kl > 0 without model.lora .* not supported with 2 ranks"):
        load_config(composer, ["executor.ranks_per_replica=2", "composer.grpo.kl=0.1", *off])
    assert (
        load_config(
            composer, ["executor.ranks_per_replica=2", "composer.grpo.kl=0.1", "model.lora.r=8", *off]
        ).ranks_per_replica
        == 2
    )
    with pytest.raises(ConfigError, match=r"composer.record_rollouts is not supported with 2 ranks"):
        load_config(composer, ["executor.ranks_per_replica=2", "composer.record_rollouts=true", *off])
    with pytest.raises(ConfigError, match=r"batch_size \(8\) must be a multiple of the 3 ranks"):
        _config({"type": "local", "ranks_per_replica": 3})


def test_local_replicas_are_pinned_to_gpus_of_their_own() -> None:
    assert gpu_assignment([], 4, 2) is None
    assert gpu_assignment(["0", "1", "2", "3"], 2, 2) == ["0,1", "2,3"]
    assert gpu_assignment(["4", "5", "6", "7"], 4, 1) == ["4", "5", "6", "7"]
    # One-rank replicas that outnumber the GPUs share them in turn, never all on the first one.
    assert gpu_assignment(["0", "1"], 4, 1) == ["0", "1", "0", "1"]
    with pytest.raises(ConfigError, match="2 replicas x 2 ranks need 4 GPUs; this machine has 3") as e:
        gpu_assignment(["0", "1", "2"], 2, 2)
    assert "CUDA_VISIBLE_DEVICES=" in str(e.value)


def test_the_visible_gpus_follow_cuda_visible_devices(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3")
    assert visible_gpus() == ["2", "3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == []


def test_a_local_plan_on_a_gpu_machine_pins_each_replica(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    config = _config({"type": "local", "ranks_per_replica": 2}).model_copy(update={"store": str(tmp_path)})
    plan = make_executor(config, ObjectStore(str(tmp_path))).plan(config, str(tmp_path))
    assert [spec.env["CUDA_VISIBLE_DEVICES"] for spec in plan.replicas] == ["0,1", "2,3"]
    assert plan.resources["devices"] == {"0": "0,1", "1": "2,3"}
