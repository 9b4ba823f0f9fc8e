"""Whether a model fits the devices a plan names: the training state's bytes against a GPU's memory.

The dry run warns (it does not refuse) when the weights, gradients and AdamW's two states of a replica, shared
by its G ranks (FSDP2 shards all of them), already exceed one GPU's memory before a single activation, or
when a large model would train on a CPU. The figure is a floor: activations, the rollouts' KV cache and
allocator slack come on top (the project measured 20 bytes per parameter at the inner step of a bf16 full
fine-tune on one H100, against the 16 counted here; docs/RESULTS.md, section 13). torchft's global copy and
the outer momentum live in host memory (``replicas/host_diloco.py``) and are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from composer_serverless.config.hardware import GPU_MEMORY_GB, flavor_gpu
from composer_serverless.executors.base import LaunchPlan

if TYPE_CHECKING:
    from composer_serverless.config import RunConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
# From here on a model on a CPU is worth a word: the project's Qwen2.5-0.5B (494M) generated 21 tokens per
# second on two cores (docs/RESULTS.md, section 14), hours for one composer round.
CPU_LARGE_PARAMETERS = 100_000_000


@dataclass(frozen=True)
class Devices:
    """What one replica trains on: ``count`` GPUs (``gpu``, a ``GPU_MEMORY_GB`` key, when the plan names
    their type; a local machine's it does not) or, with ``on_gpu`` False, the CPU (``count`` ranks)."""

    on_gpu: bool
    count: int
    gpu: str | None = None

    @property
    def memory_gb(self) -> int | None:
        return None if self.gpu is None else GPU_MEMORY_GB[self.gpu]

    def describe(self) -> str:
        if not self.on_gpu:
            return "cpu"
        if self.gpu is None:
            return f"{self.count} local GPU{'s' if self.count > 1 else ''} per replica"
        return f"{self.count} x {self.gpu} ({self.memory_gb} GB) per replica"


def plan_devices(config: RunConfig, plan: LaunchPlan) -> Devices:
    """The devices ``plan`` gives each replica."""
    ex = config.executor
    if ex.type == "modal":
        return Devices(True, ex.gpu_count, ex.gpu)
    if ex.type == "hf_jobs":
        gpu = flavor_gpu(ex.flavor)
        return Devices(gpu is not None, max(1, ex.gpus), gpu)
    return Devices(plan.resources.get("devices", "cpu") != "cpu", config.ranks_per_replica)


def training_bytes(parameters: dict[str, int], dtype: str, master_dtype: str, optimizer: str) -> int:
    """Bytes of one replica's training state: per trainable parameter its master weight, its gradient and
    the optimizer's states (AdamW two, plain SGD none), all in ``master_dtype``; per frozen parameter (LoRA's
    base) its weight in ``dtype``."""
    states = 2 if optimizer == "adamw" else 0
    trainable = parameters["trainable"]
    frozen = parameters["total"] - trainable
    return trainable * (2 + states) * DTYPE_BYTES[master_dtype] + frozen * DTYPE_BYTES[dtype]


def warnings(config: RunConfig, devices: Devices, parameters: dict[str, int]) -> list[str]:
    """What the dry run warns about the model on ``devices``: its training state past a GPU's memory, or a
    large model on a CPU. Empty when neither."""
    total = parameters["total"]
    state = training_bytes(parameters, config.model.dtype, config.model.master_dtype, config.train.optimizer)
    per_device = state / devices.count
    size = f"{total / 1e6:,.0f}M parameters"
    if not devices.on_gpu:
        if total < CPU_LARGE_PARAMETERS:
            return []
        return [
            f"the replicas train on the CPU (devices: cpu) and the model has {size} ({state / 1e9:.1f} GB of "
            "weights, gradients and optimizer state per replica): far slower than on a GPU (Qwen2.5-0.5B "
            "generated 21 tokens/s on two cores, docs/RESULTS.md)\n"
            "  fix: run it on GPUs: --executor modal or hf_jobs, or on a machine whose GPUs nvidia-smi lists"
        ]
    memory = devices.memory_gb
    if memory is None or per_device <= memory * 1e9:
        return []
    return [
        f"the model has {size}: its weights, gradients and optimizer state take {per_device / 1e9:.1f} GB per "
        f"GPU (a replica has {devices.count} x {devices.gpu}), more than the {memory} GB a {devices.gpu} has, "
        "before any activation\n"
        "  fix: a larger GPU, more GPUs per replica (their ranks shard the state), model.lora, or "
        "model.master_dtype = 'bfloat16'"
    ]
