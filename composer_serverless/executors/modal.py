"""``ModalExecutor``: one Modal function call per replica, spawned inside a detached app.

What Modal teaches (see the project's research notes on Modal):

* Every replica is a ``spawn`` of one GPU function (``modal_app.train_replica``), so each has its own call
  id to poll, read logs from and cancel, and Modal's own retries restart it after a preemption or crash
  (``Retries`` with a fixed delay; each attempt gets a fresh container and a full timeout). The launcher
  therefore does not relaunch Modal replicas itself.
* The app runs **detached**: leaving a plain ``app.run()`` block would stop every spawned replica.
* The timeout is always explicit (Modal's default of 300 s kills a real run) and the function has no
  container cap, since a cap below N would queue replicas behind a sync barrier that waits for them.
* GPU type, timeout, retries, secrets and environment are per-run options (``with_options``), not decorator
  arguments: decorator arguments are evaluated again in every container, where the launcher's config is gone.
* Secrets go to Modal as a ``Secret`` built from this environment at spawn time (plus any named secrets of
  the workspace); their values never enter the plan, the command or a log.

Every call that needs Modal's servers sits behind ``ModalCalls``, a seam of four methods; ``ModalSDKCalls``
is the real one, and tests substitute a fake that records the calls.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from composer_serverless.config import RunConfig
from composer_serverless.config.hardware import MODAL_GPU_PRICES
from composer_serverless.executors.base import (
    LaunchPlan,
    ReplicaHandle,
    ReplicaSpec,
    ReplicaState,
    ReplicaStatus,
    worker_argv,
)
from composer_serverless.executors.environment import (
    check_cloud_plan,
    cloud_env,
    launch_secrets,
    present_secrets,
    secret_name_problems,
)
from composer_serverless.executors.modal_image import (
    APP_NAME,
    IMAGE_REQUIREMENTS,
    PYTHON_VERSION,
    RETRY_DELAY_S,
)
from composer_serverless.executors.pricing import estimate_cost


@dataclass(frozen=True)
class SpawnRequest:
    """What to spawn: plain values only, so a fake can record it and a test can assert it."""

    run_url: str
    ranks: tuple[int, ...]
    gpu: str
    timeout_s: int
    retries: int
    env: dict[str, str]
    secret_env: tuple[str, ...]
    modal_secrets: tuple[str, ...]
    # Values of the secrets the launcher made for this run (the run key), by name; never shown in a repr.
    run_secrets: dict[str, str] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class Spawned:
    app_id: str
    call_ids: dict[int, str]


class ModalCalls(Protocol):
    """The seam: each method is one conversation with Modal's servers, and nothing else talks to them."""

    def spawn(self, request: SpawnRequest) -> Spawned: ...

    def poll(self, call_id: str) -> tuple[ReplicaState, str]:
        """(state, detail) of one call: running, succeeded, failed or cancelled."""
        ...

    def logs(self, call_id: str, follow: bool) -> Iterator[str]: ...

    def cancel(self, call_id: str) -> None: ...


class ModalSDKCalls:
    """``ModalCalls`` through the modal SDK (needs a Modal token and Modal's servers)."""

    def spawn(self, request: SpawnRequest) -> Spawned:
        import modal

        from composer_serverless.executors.modal_app import app, train_replica

        secrets = [modal.Secret.from_name(name) for name in request.modal_secrets]
        if request.secret_env:
            secrets.insert(0, modal.Secret.from_dict(launch_secrets(request.secret_env, request.run_secrets)))
        function = train_replica.with_options(
            gpu=request.gpu,
            timeout=request.timeout_s,
            retries=modal.Retries(
                max_retries=request.retries, initial_delay=RETRY_DELAY_S, backoff_coefficient=1.0
            ),
            secrets=secrets,
            env=dict(request.env),
        )
        with modal.enable_output(), app.run(detach=True):
            calls = {rank: function.spawn(request.run_url, rank) for rank in request.ranks}
            app_id = app.app_id or ""
        return Spawned(app_id, {rank: call.object_id for rank, call in calls.items()})

    def poll(self, call_id: str) -> tuple[ReplicaState, str]:
        import modal

        try:
            modal.FunctionCall.from_id(call_id).get(timeout=0)
        except TimeoutError:  # the built-in one: no result yet (modal's own TimeoutError is not a subclass)
            return "running", ""
        except modal.exception.FunctionTimeoutError as e:
            return "failed", f"timed out after its retries: {e}"
        except modal.exception.InputCancellation:
            return "cancelled", "cancelled"
        except Exception as e:  # the replica's own exception, re-raised here once Modal's retries are spent
            return "failed", f"{type(e).__name__}: {e}"
        return "succeeded", ""

    def logs(self, call_id: str, follow: bool) -> Iterator[str]:
        import modal

        call = modal.FunctionCall.from_id(call_id)
        entries = call.logs.stream() if follow else call.logs.fetch()
        for entry in entries:
            yield from entry.message.splitlines()

    def cancel(self, call_id: str) -> None:
        import modal

        modal.FunctionCall.from_id(call_id).cancel(terminate_containers=True)


class ModalExecutor:
    name = "modal"

    def __init__(self, calls: ModalCalls | None = None) -> None:
        self._calls_instance = calls
        self.run_secrets: dict[str, str] = {}

    @property
    def _calls(self) -> ModalCalls:
        if self._calls_instance is None:
            self._calls_instance = ModalSDKCalls()
        return self._calls_instance

    def plan(self, config: RunConfig, run_url: str) -> LaunchPlan:
        ex = config.executor
        replicas = config.diloco.replicas
        check_cloud_plan(config, "Modal", at_once=f"{replicas * ex.gpu_count} {ex.gpu} GPUs")
        env = cloud_env()
        secrets = present_secrets(config)
        specs = tuple(ReplicaSpec(rank, worker_argv(run_url, rank), env, secrets) for rank in range(replicas))
        gpu_price = ex.price_per_gpu_hour or MODAL_GPU_PRICES[ex.gpu]
        basis = "executor.price_per_gpu_hour" if ex.price_per_gpu_hour else f"Modal list price of {ex.gpu}"
        cost = estimate_cost(
            config,
            price_per_replica_hour=gpu_price * ex.gpu_count,
            price_basis=f"{basis}, ${gpu_price:.2f}/GPU-hour x {ex.gpu_count}",
            gpus_per_replica=ex.gpu_count,
        )
        return LaunchPlan(
            executor=self.name,
            run_id=config.run_id or "",
            run_url=run_url,
            replicas=specs,
            cost=cost,
            resources={
                "app": APP_NAME,
                "function": "train_replica",
                "gpu": _gpu_option(ex.gpu, ex.gpu_count),
                "timeout_s": ex.timeout_s,
                "retries": ex.max_restarts,
                "retry_delay_s": RETRY_DELAY_S,
                "max_containers": None,
                "single_use_containers": True,
                "image": {"python": PYTHON_VERSION, "requirements": list(IMAGE_REQUIREMENTS)},
                "modal_secrets": list(ex.modal_secrets),
                "detached": True,
            },
            ranks_per_replica=config.ranks_per_replica,
            launcher_restarts=0,
        )

    def preflight(self, plan: LaunchPlan) -> list[str]:
        problems = secret_name_problems(plan.replicas[0].secrets)
        try:
            import modal
        except ImportError:
            return [
                *problems,
                "the modal package is not installed\n  fix: pip install 'composer-serverless[modal]'",
            ]
        if not (modal.config.config.get("token_id") and modal.config.config.get("token_secret")):
            problems.append(
                "no Modal token: neither MODAL_TOKEN_ID/MODAL_TOKEN_SECRET nor a ~/.modal.toml profile\n"
                "  fix: run `modal token new` (or export MODAL_TOKEN_ID and MODAL_TOKEN_SECRET)"
            )
        return problems

    def launch(self, plan: LaunchPlan) -> list[ReplicaHandle]:
        res = plan.resources
        first = plan.replicas[0]
        request = SpawnRequest(
            run_url=plan.run_url,
            ranks=tuple(spec.rank for spec in plan.replicas),
            gpu=res["gpu"],
            timeout_s=res["timeout_s"],
            retries=res["retries"],
            env=dict(first.env),
            secret_env=first.secrets,
            modal_secrets=tuple(res["modal_secrets"]),
            run_secrets=dict(self.run_secrets),
        )
        spawned = self._calls.spawn(request)
        return [
            ReplicaHandle(rank, call_id, f"modal call {call_id}", meta={"app_id": spawned.app_id})
            for rank, call_id in sorted(spawned.call_ids.items())
        ]

    def status(self, handles: list[ReplicaHandle]) -> list[ReplicaStatus]:
        statuses = []
        for handle in handles:
            state, detail = self._calls.poll(handle.backend_id)
            statuses.append(ReplicaStatus(handle.rank, state, 0 if state == "succeeded" else None, detail))
        return statuses

    def logs(self, handle: ReplicaHandle, follow: bool = False) -> Iterator[str]:
        yield from self._calls.logs(handle.backend_id, follow)

    def cancel(self, handles: list[ReplicaHandle]) -> None:
        for handle in handles:
            self._calls.cancel(handle.backend_id)


def _gpu_option(gpu: str, count: int) -> str:
    return gpu if count == 1 else f"{gpu}:{count}"
