"""The dry run's arithmetic, by hand: the training state's bytes against a GPU, the GPU a device name is, the
measured step time a plan may use, and the expected cost from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from composer_serverless.config import validate_config
from composer_serverless.executors import fit, measured, pricing
from composer_serverless.executors.base import CostEstimate, LaunchPlan
from composer_serverless.executors.pricing import estimate_cost

# Qwen2.5-1.5B's parameters (embedding tied): 151936 x 1536 + 28 x 46,797,824 per layer + 1536 final norm.
QWEN_15B = 1_543_714_304


def _config(executor: dict, **more: dict) -> object:
    raw = {
        "store": "s3://bucket/runs",
        "model": {"path": "some/model"},
        "diloco": {"replicas": 4, "sync_every": 10, "rounds": 30},
        "executor": executor,
        **more,
    }
    return validate_config(raw, source="the test")


def _plan(devices: object = "cpu") -> LaunchPlan:
    free = CostEstimate(0.0, "local processes", 0, 0.0, 0.0)
    return LaunchPlan("local", "r", "u", (), free, {"devices": devices})


def test_training_bytes_count_masters_gradients_and_adamw_and_frozen_weights() -> None:
    full = {"total": 1000, "trainable": 1000}
    assert fit.training_bytes(full, "bfloat16", "float32", "adamw") == 1000 * (4 + 4 + 8)
    assert fit.training_bytes(full, "bfloat16", "bfloat16", "adamw") == 1000 * (2 + 2 + 4)
    assert fit.training_bytes(full, "float32", "float32", "sgd") == 1000 * (4 + 4)
    lora = {"total": 1000, "trainable": 100}  # 900 frozen in bf16, 100 trained in float32 with AdamW
    assert fit.training_bytes(lora, "bfloat16", "float32", "adamw") == 900 * 2 + 100 * 16


def test_a_model_past_one_gpu_is_warned_about_and_its_ranks_share_it() -> None:
    params = {"total": QWEN_15B, "trainable": QWEN_15B}
    t4 = _config({"type": "modal", "gpu": "T4"})
    devices = fit.plan_devices(t4, _plan())
    assert devices == fit.Devices(True, 1, "T4") and devices.memory_gb == 16
    (warning,) = fit.warnings(t4, devices, params)
    # 1,543,714,304 x 16 bytes = 24.70 GB against 16 GB.
    assert warning.startswith(
        "the model has 1,544M parameters: its weights, gradients and optimizer state take 24.7 GB per GPU "
        "(a replica has 1 x T4), more than the 16 GB a T4 has, before any activation\n  fix: "
    )
    two = _config({"type": "modal", "gpu": "T4", "gpu_count": 2})  # 12.35 GB per rank
    assert fit.warnings(two, fit.plan_devices(two, _plan()), params) == []
    l40s = _config({"type": "modal", "gpu": "L40S"})
    assert fit.warnings(l40s, fit.plan_devices(l40s, _plan()), params) == []


def test_a_large_model_on_the_cpu_is_said_and_a_small_one_is_not() -> None:
    local = _config({"type": "local"}, store="runs")
    devices = fit.plan_devices(local, _plan("cpu"))
    assert devices.describe() == "cpu"
    (warning,) = fit.warnings(local, devices, {"total": 494_032_768, "trainable": 494_032_768})
    assert "train on the CPU (devices: cpu) and the model has 494M parameters (7.9 GB of" in warning
    assert fit.warnings(local, devices, {"total": 99_999_999, "trainable": 99_999_999}) == []
    on_gpus = fit.plan_devices(local, _plan({"0": "0"}))
    assert on_gpus.describe() == "1 local GPU per replica" and on_gpus.memory_gb is None


def test_hf_flavors_name_their_gpus() -> None:
    a100 = _config({"type": "hf_jobs", "flavor": "a100x4"})
    assert fit.plan_devices(a100, _plan()).describe() == "4 x A100-80GB (80 GB) per replica"
    cpu = _config({"type": "hf_jobs", "flavor": "cpu-upgrade"})
    assert fit.plan_devices(cpu, _plan()) == fit.Devices(False, 1, None)


@pytest.mark.parametrize(
    ("name", "gpu"),
    [
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA A100-PCIE-40GB", "A100-40GB"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA A10G", "A10G"),
        ("Tesla T4", "T4"),
        ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "RTX-PRO-6000"),
        ("NVIDIA GH200 480GB", None),
        ("x86_64 CPU, simulated accelerator", None),
    ],
)
def test_device_names_map_to_gpu_types(name: str, gpu: str | None) -> None:
    assert measured.device_gpu(name) == gpu


def _result(tmp_path: Path, name: str, **top: object) -> None:
    config = _config({"type": "modal"})
    line = {
        "line": "lm",
        "exit_code": 0,
        "step_s": {"generate": 0.0, "forward_backward": 2.0, "optimizer": 0.4, "sync": 0.1},
        "params": {"total": QWEN_15B},
        "workload": measured.workload(config),
    }
    doc = {"device": "NVIDIA H100 80GB HBM3", "cuda": True, "date": "2026-11-20", "commit": "abc1234"}
    (tmp_path / name).write_text(json.dumps({**doc, **top, "lines": [line]}))


def test_measurements_are_read_from_gpu_check_files_and_matched_by_gpu_workload_and_size(
    tmp_path: Path,
) -> None:
    _result(tmp_path, "h100.json")
    _result(tmp_path, "cpu.json", device="x86_64 CPU, simulated accelerator", cuda=False)
    _result(tmp_path, "undated.json", date=None)
    (found,) = measured.load(tmp_path)
    assert found.seconds_per_step == pytest.approx(2.5) and found.gpu == "H100"
    assert found.source() == "measured on NVIDIA H100 80GB HBM3, 2026-11-20, commit abc1234"
    config = _config({"type": "modal"})
    assert measured.find([found], "H100", QWEN_15B, config) == found
    assert measured.find([found], "H100", int(QWEN_15B * 1.11), config) is None  # past 10 %
    assert measured.find([found], "H200", QWEN_15B, config) is None
    longer = _config({"type": "modal"}, data={"seq_len": 256})
    assert measured.find([found], "H100", QWEN_15B, longer) is None
    assert measured.load(tmp_path / "absent") == []


def test_the_expected_cost_at_a_measured_step_time(tmp_path: Path) -> None:
    _result(tmp_path, "h100.json")
    (found,) = measured.load(tmp_path)
    config = _config({"type": "modal"})  # H100 at $3.95, 4 replicas, 3 attempts of 6 h
    cost = pricing.with_measured(
        estimate_cost(config, price_per_replica_hour=3.95, price_basis="list", gpus_per_replica=1),
        config,
        found,
    )
    # One replica: 300 s + 30 rounds x 10 steps x 2.5 s = 1,050 s; 4 replicas: 1.1667 h; x $3.95 = $4.61.
    assert cost.expected_replica_hours == 1.1667 and cost.expected_usd == 4.61
    assert cost.max_usd == round(4 * 3 * 6 * 3.95, 2)  # the cap is kept
    assert cost.summary().startswith(
        "expected $4.61 (1.17 replica-hours; 30 rounds x 10 steps x 2.5 s/step + 300 s start-up per replica, "
        "measured on NVIDIA H100 80GB HBM3, 2026-11-20, commit abc1234); at most $284.40 (72.00 replica-hours"
    )
    # The user's own step time wins over the project's.
    own = _config({"type": "modal", "seconds_per_step": 1.0})
    mine = estimate_cost(own, price_per_replica_hour=3.95, price_basis="list", gpus_per_replica=1)
    assert pricing.with_measured(mine, own, found) == mine and "executor.seconds_per_step" in mine.summary()
