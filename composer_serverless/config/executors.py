"""The executors' schemas: where replicas run (local processes, Modal, HF Jobs) and what each backend needs.

``ExecutorConfig`` is a union discriminated on ``type``; a table without one means the local backend. The
GPU types and flavors are checked against ``hardware.py``, so a typo fails before anything is launched.
"""

from __future__ import annotations

import difflib
import re
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator

from composer_serverless.config.base import StrictModel
from composer_serverless.config.hardware import HF_FLAVOR_PRICES, MODAL_GPU_PRICES, flavor_gpus

ENV_NAME_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MODAL_NAME_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,63}$")
HF_NAMESPACE_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
# A stock Python image: the replicas pip-install the tested torch build (``executors/runtime.py``, which brings
# its own CUDA libraries; the host gives the driver) and the package (executor.package) at start.
DEFAULT_HF_JOBS_IMAGE = "python:3.11-slim"


class LocalExecutorConfig(StrictModel):
    """Replicas as local subprocesses: the debugging backend."""

    type: Literal["local"] = "local"
    threads_per_replica: int | None = Field(
        None, ge=1, description="torch threads per replica; default shares the CPU cores evenly"
    )
    max_replicas: int = Field(
        32, ge=1, le=1024, description="most replicas this machine may run; a guard against a mistyped count"
    )
    max_restarts: int = Field(
        0,
        ge=0,
        le=10,
        description="times the launcher starts a dead replica again; 0 fails the run at the first death, "
        "which is what a local bug usually wants",
    )
    ranks_per_replica: int = Field(
        1,
        ge=1,
        le=8,
        description="processes per replica, sharding the model with FSDP2: one GPU each when the machine has "
        "GPUs (every replica pinned to its own), else CPU processes over gloo",
    )


class _CloudExecutorConfig(StrictModel):
    """What every paid backend needs: a spend guard, a timeout covering the work, restarts, secrets."""

    max_replicas: int = Field(
        16, ge=1, le=1024, description="most replicas a launch may start (it caps the bill; raise on purpose)"
    )
    timeout_s: int = Field(
        6 * 3600,
        ge=60,
        description="seconds one replica attempt may run before the backend stops it (and its billing)",
    )
    max_restarts: int = Field(
        2, ge=0, le=10, description="times a dead or preempted replica is started again before the run fails"
    )
    seconds_per_step: float | None = Field(
        None,
        gt=0,
        description="measured seconds per inner step on this hardware; enables the expected-cost estimate "
        "and the check that timeout_s covers the configured steps",
    )
    startup_s: float = Field(
        300.0, ge=0, description="seconds a replica spends before its first step (image pull, model download)"
    )
    status_poll_s: float = Field(
        10.0,
        ge=0.1,
        description="seconds between status requests to the backend while watching (each is one API call); "
        "progress from the store updates every second, or this often if it is shorter",
    )
    secrets: tuple[str, ...] = Field(
        (),
        description="extra environment variable names whose values reach the replicas as secrets "
        "(the store's and the Hub's credentials are added automatically)",
    )
    api_retry_s: float = Field(
        60.0,
        ge=0,
        le=3600,
        description="seconds a backend API call refused for a transient reason (rate limit, server error, "
        "network) is retried, honouring Retry-After, before the command gives up with exit status 1",
    )
    private_store_endpoint: bool = Field(
        False,
        description="allow a store endpoint (AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL) on loopback or a private "
        "network: only for replicas that really reach it (a tunnel into that network); cloud replicas "
        "cannot reach this machine's localhost",
    )

    @field_validator("secrets")
    @classmethod
    def _secret_names(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        return _all_match(
            names, ENV_NAME_PATTERN, "environment variable names (letters, digits, '_'; not values)"
        )


class ModalExecutorConfig(_CloudExecutorConfig):
    """Replicas as Modal functions, one GPU container each, spawned in a detached app."""

    type: Literal["modal"] = "modal"
    gpu: str = Field("H100", description="Modal GPU type per replica, e.g. H100, A100-80GB, L40S")
    gpu_count: int = Field(1, ge=1, le=8, description="GPUs per replica container")
    timeout_s: int = Field(
        6 * 3600,
        ge=60,
        le=24 * 3600,
        description="seconds one replica attempt may run (Modal allows at most 24 h; its default of 300 s "
        "would kill any real run)",
    )
    modal_secrets: tuple[str, ...] = Field(
        (), description="names of secrets already stored in your Modal workspace to attach to every replica"
    )
    price_per_gpu_hour: float | None = Field(
        None, gt=0, description="USD per GPU-hour for the cost estimate; default is Modal's list price"
    )
    syncer_cpu: float = Field(
        2.0,
        ge=0.125,
        le=64,
        description="physical CPU cores of the syncer's container (diloco.mode = 'decoupled'; it has no GPU: it "
        "merges in host memory)",
    )
    syncer_memory_mb: int = Field(
        8192,
        ge=512,
        le=262144,
        description="MiB of memory of the syncer's container (decoupled mode): it holds the global, the outer "
        "momentum and one contribution per learner, in float32",
    )

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, gpu: str) -> str:
        return _known_name(gpu.upper(), MODAL_GPU_PRICES, "GPU type", hint="put the count in gpu_count")

    @field_validator("modal_secrets")
    @classmethod
    def _modal_secret_names(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        return _all_match(
            names, MODAL_NAME_PATTERN, "Modal secret names (letters, digits, '.', '_', '-'; < 64 chars)"
        )


class HFJobsExecutorConfig(_CloudExecutorConfig):
    """Replicas as Hugging Face Jobs, one job per replica, labelled with the run and the rank."""

    type: Literal["hf_jobs"] = "hf_jobs"
    flavor: str = Field("a100-large", description="HF Jobs hardware flavor per replica, e.g. a100-large")
    image: str = Field(
        DEFAULT_HF_JOBS_IMAGE,
        min_length=1,
        description="public Docker image the replicas run in: the stock Python image (the tested torch build "
        "and executor.package are installed at start), or one built from deploy/hf_jobs/Dockerfile that "
        "already contains both",
    )
    package: str | None = Field(
        None,
        min_length=1,
        description="pip requirement installed in the image before the worker starts, e.g. "
        "'composer-serverless[s3,hf,parquet] @ https://github.com/you/composer-serverless/archive/<commit>.tar.gz'; "
        "unset when the image already contains the package",
    )
    namespace: str | None = Field(
        None,
        description="user or organisation the jobs run and bill under; unset: your token's user, found once",
    )
    timeout_s: int = Field(
        6 * 3600,
        ge=60,
        le=7 * 24 * 3600,
        description="seconds one replica job may run (HF Jobs' default, 30 minutes, cuts real runs short)",
    )
    scheduling_deadline_s: float = Field(
        1800.0,
        ge=1,
        description="seconds a replica may wait for hardware (SCHEDULING) before it is cancelled and the run "
        "goes on without it",
    )
    price_per_hour: float | None = Field(
        None, gt=0, description="USD per job-hour for the cost estimate; default is the flavor's list price"
    )
    syncer_flavor: str = Field(
        "cpu-upgrade",
        description="HF Jobs CPU flavor of the syncer's job (diloco.mode = 'decoupled'; it merges in host memory, "
        "so a GPU flavor would bill for an idle GPU), e.g. cpu-basic, cpu-upgrade, cpu-xl",
    )

    @property
    def gpus(self) -> int:
        return flavor_gpus(self.flavor)

    @field_validator("flavor")
    @classmethod
    def _known_flavor(cls, flavor: str) -> str:
        return _known_name(flavor.lower(), HF_FLAVOR_PRICES, "flavor")

    @field_validator("syncer_flavor")
    @classmethod
    def _cpu_flavor(cls, flavor: str) -> str:
        flavor = _known_name(flavor.lower(), HF_FLAVOR_PRICES, "flavor")
        if flavor_gpus(flavor):
            cpu = ", ".join(f for f in HF_FLAVOR_PRICES if not flavor_gpus(f))
            raise ValueError(
                f"executor.syncer_flavor {flavor!r} has GPUs; the syncer merges on the CPU and would leave them "
                f"idle at {flavor}'s price\n  fix: one of {cpu}"
            )
        return flavor

    @field_validator("namespace")
    @classmethod
    def _namespace_name(cls, namespace: str | None) -> str | None:
        if namespace is not None and not HF_NAMESPACE_PATTERN.match(namespace):
            raise ValueError(f"{namespace!r} is not a Hugging Face user or organisation name")
        return namespace


def _all_match(names: tuple[str, ...], pattern: re.Pattern[str], what: str) -> tuple[str, ...]:
    bad = [n for n in names if not pattern.match(n)]
    if bad:
        raise ValueError(f"{bad} are not {what}")
    return names


def _known_name(name: str, known: dict[str, float], what: str, hint: str = "") -> str:
    if name in known:
        return name
    close = difflib.get_close_matches(name, list(known), n=1)
    suggestion = f"did you mean {close[0]!r}? " if close else ""
    extra = f"; {hint}" if hint and ":" in name else ""
    raise ValueError(f"unknown {what} {name!r}; {suggestion}known: {', '.join(known)}{extra}")


def _executor_type(value: Any) -> str:
    """The executor's ``type``; a table without one means the local backend."""
    return value.get("type", "local") if isinstance(value, dict) else getattr(value, "type", "local")


ExecutorConfig = Annotated[
    Annotated[LocalExecutorConfig, Tag("local")]
    | Annotated[ModalExecutorConfig, Tag("modal")]
    | Annotated[HFJobsExecutorConfig, Tag("hf_jobs")],
    Discriminator(_executor_type),
]
EXECUTOR_TYPES = ("local", "modal", "hf_jobs")
