"""Step times the project measured on a GPU (``make gpu-check``), for the plan's expected cost.

``benchmarks/gpu_check.py`` writes one file per device to ``docs/results/gpu/``: per line the seconds of an
inner step by phase, the model's parameters and the step's ``workload`` (the settings that decide how much
work a step is). A plan uses a line's step time only for the same GPU, the same workload and a model within
``SIZE_TOLERANCE`` of the line's size, and says where the figure comes from; otherwise it says there is
none. Files without a date, a commit or workloads (older ones, and the CPU's, which runs the GPU path on a
simulated device and says nothing of a GPU's speed) are passed over.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from composer_serverless.config.hardware import GPU_MEMORY_GB

if TYPE_CHECKING:
    from composer_serverless.config import RunConfig

logger = logging.getLogger(__name__)

# Where gpu-check writes, in a checkout of the project (an installed package has no measurements).
RESULTS_DIR = Path(__file__).resolve().parents[2] / "docs" / "results" / "gpu"
# How far a model's size may be from the measured one's for the step time to carry over (a step's work
# grows about linearly with the parameters).
SIZE_TOLERANCE = 0.1


@dataclass(frozen=True)
class Measurement:
    """One gpu-check line on one GPU: seconds per inner step for ``parameters`` at ``workload``."""

    device: str
    gpu: str
    parameters: int
    workload: dict[str, Any]
    seconds_per_step: float
    date: str
    commit: str

    def source(self) -> str:
        return f"measured on {self.device}, {self.date}, commit {self.commit}"


def workload(config: RunConfig) -> dict[str, Any]:
    """The settings that decide a step's work, besides the model's size: what a measurement must share with a
    run for its step time to be the run's."""
    model, train = config.model, config.train
    shared: dict[str, Any] = {
        "objective": train.objective,
        "dtype": model.dtype,
        "lora_r": None if model.lora is None else model.lora.r,
        "gradient_checkpointing": model.gradient_checkpointing,
        "micro_batch_size": train.micro_batch_size,
        "ranks_per_replica": config.ranks_per_replica,
    }
    if config.composer is None:
        return {**shared, "batch_size": config.data.batch_size, "seq_len": config.data.seq_len}
    rollout = config.composer.rollout
    return {
        **shared,
        "prompts_per_step": rollout.prompts_per_step,
        "group_size": rollout.group_size,
        "max_new_tokens": rollout.max_new_tokens,
        "engine": rollout.engine,
    }


def device_gpu(device: str) -> str | None:
    """The GPU type (a ``GPU_MEMORY_GB`` key) of a CUDA device name as torch gives it ("NVIDIA H100 80GB
    HBM3", "NVIDIA A100-SXM4-40GB"), None for one the tables do not know."""
    name = device.upper().replace(" ", "-")
    if "A100" in name:
        return "A100-80GB" if "80GB" in name else "A100-40GB"
    known = sorted((g for g in GPU_MEMORY_GB if g.isalnum() or "-" in g), key=len, reverse=True)
    return next((g for g in known if re.search(rf"(^|[^A-Z0-9]){re.escape(g)}($|[^A-Z0-9])", name)), None)


def load(directory: Path | None = None) -> list[Measurement]:
    """Every usable line of the gpu-check files in ``directory`` (default ``RESULTS_DIR``; none when it does
    not exist)."""
    directory = RESULTS_DIR if directory is None else directory
    found = []
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else ():
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            logger.warning("passing over %s: %s", path, e)
            continue
        gpu = device_gpu(result.get("device", "")) if result.get("cuda") else None
        if gpu is None or not result.get("date") or not result.get("commit"):
            continue
        for line in result.get("lines", []):
            if (
                line.get("exit_code") == 0
                and "workload" in line
                and line.get("step_s")
                and line.get("params")
            ):
                found.append(
                    Measurement(
                        device=result["device"],
                        gpu=gpu,
                        parameters=line["params"]["total"],
                        workload=line["workload"],
                        seconds_per_step=sum(line["step_s"].values()),
                        date=result["date"],
                        commit=result["commit"],
                    )
                )
    return found


def find(measurements: list[Measurement], gpu: str, parameters: int, config: RunConfig) -> Measurement | None:
    """The newest measurement on ``gpu`` of ``config``'s workload for a model of ``parameters`` within
    ``SIZE_TOLERANCE`` of the measured model's size; None when the project has none."""
    wanted = workload(config)
    fitting = [
        m
        for m in measurements
        if m.gpu == gpu
        and m.workload == wanted
        and abs(m.parameters - parameters) <= SIZE_TOLERANCE * m.parameters
    ]
    return max(fitting, key=lambda m: m.date, default=None)
