"""``ModalExecutor``: one Modal function call per replica, each spawned in a detached app of its own.

What Modal teaches (see the project's research notes on Modal):

* Every replica is a ``spawn`` of one GPU function (``modal_app.train_replica``), so each has its own call
  id to poll, read logs from and cancel, and Modal's own retries restart it after a preemption or crash
  (``Retries`` with a fixed delay; each attempt gets a fresh container and a full timeout). The launcher
  therefore does not relaunch Modal replicas itself.
* Each call runs in a **detached** app of its own (leaving a plain ``app.run()`` block would stop the
  replicas). The app's id is recorded before the call is spawned, and stopping that app ends whatever it
  holds, so a replica is never out of ``cancel``'s reach, even one whose call id never got recorded.
* ``app.run(detach=True)`` swallows a KeyboardInterrupt raised inside its block (Modal's runner prints "the
  detached App will keep running" and returns): the spawn here keeps such an interrupt and raises it after
  the block, so the launcher still asks whether to cancel or detach.
* A call that was cancelled (``cancel RUN``, the dashboard, ``modal app stop``) comes back as a terminated
  result, which the client raises as ``RemoteError`` (``modal._utils.function_utils._process_result``): that
  is a cancellation, not a failure. The replica's own exception comes back as itself.
* Log entries are chunks of the container's output as it wrote them, not lines: they are joined and split
  again into whole lines.
* The timeout is always explicit (Modal's default of 300 s kills a real run) and the function has no
  container cap, since a cap below N would queue replicas behind a sync barrier that waits for them.
* GPU type, timeout, retries, secrets and environment are per-run options (``with_options``), not decorator
  arguments: decorator arguments are evaluated again in every container, where the launcher's config is gone.
  The variant is made inside each replica's ``app.run`` block: it binds to the app running when it is first
  used (``_make_function_variant`` hydrates it once, from the function of that app) and stays bound, so one
  variant for every replica would spawn them all in the first replica's app.
* Secrets go to Modal as a ``Secret`` built from this environment at spawn time (plus any named secrets of
  the workspace); their values never enter the plan, the command or a log.
* In decoupled mode the syncer (the rank after the learners', or with ``diloco.decoupled.syncer_shards`` one
  rank per shard) is a spawn of a second function of the same app, ``modal_app.syncer``, once per shard,
  which has no GPU: its cores and memory are per-run options too (``executor.syncer_cpu``,
  ``syncer_memory_mb``, each shard's). Each shard gets its own detached app, retries, timeout and secrets
  exactly as a replica does, so status, logs and cancel reach it the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from composer_serverless.accelerator import ACCELERATOR_ENV
from composer_serverless.config import RunConfig
from composer_serverless.config.hardware import MODAL_CPU_CORE_PRICE, MODAL_GPU_PRICES, MODAL_MEMORY_GIB_PRICE
from composer_serverless.executors import retrying, shipment
from composer_serverless.executors.base import (
    BackendError,
    CostEstimate,
    Journal,
    LaunchPlan,
    LaunchRecord,
    ReplicaHandle,
    ReplicaSpec,
    ReplicaState,
    ReplicaStatus,
    syncer_resources,
    worker_argv,
)
from composer_serverless.executors.environment import (
    check_cloud_plan,
    cloud_env,
    launch_secrets,
    present_secrets,
    secret_name_problems,
)
from composer_serverless.executors.modal_errors import classify
from composer_serverless.executors.modal_image import (
    APP_NAME,
    IMAGE_REQUIREMENTS,
    PYTHON_VERSION,
    RETRY_DELAY_S,
    SHIPMENT_ENV,
)
from composer_serverless.executors.pricing import estimate_cost
from composer_serverless.executors.runtime import torch_build

T = TypeVar("T")
# Log entries asked for per line wanted, when only the end of a log is read (an entry is a chunk of output,
# usually a line or less).
TAIL_ENTRIES_PER_LINE = 4


class ModalExecutor:
    name = "modal"

    def __init__(self, retry_s: float = 60.0) -> None:
        self._retry_s = retry_s
        self.run_secrets: dict[str, str] = {}

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        return retrying.call(fn, lambda e: classify(e, what), budget_s=self._retry_s, what=what)

    def plan(self, config: RunConfig, run_url: str) -> LaunchPlan:
        ex = config.executor
        replicas = config.diloco.replicas
        check_cloud_plan(config, "Modal", at_once=f"{replicas * ex.gpu_count} {ex.gpu} GPUs")
        env = {**cloud_env(), ACCELERATOR_ENV: "cuda"}  # every Modal replica is given GPUs
        secrets = present_secrets(config)
        specs = tuple(ReplicaSpec(rank, worker_argv(run_url, rank), env, secrets) for rank in range(replicas))
        # The syncer's shards: no GPU, they merge in host memory
        specs += tuple(
            ReplicaSpec(rank, worker_argv(run_url, rank), cloud_env(), secrets)
            for rank in config.diloco.syncer_ranks
        )
        syncer = _syncer_resources(config)
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
            syncer_cost=None if syncer is None else _syncer_cost(config),
            resources={
                "syncer": syncer,
                "app": APP_NAME,
                "function": "train_replica",
                "gpu": _gpu_option(ex.gpu, ex.gpu_count),
                "timeout_s": ex.timeout_s,
                "retries": ex.max_restarts,
                "retry_delay_s": RETRY_DELAY_S,
                "max_containers": None,
                "single_use_containers": True,
                "image": {
                    "python": PYTHON_VERSION,
                    **torch_build(),
                    "requirements": list(IMAGE_REQUIREMENTS),
                },
                "modal_secrets": list(ex.modal_secrets),
                "shipped": shipment.plan(config, cloud=True).describe(shipment.IMAGE),
                "detached": True,
                "app_per_replica": True,
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

    def check_access(self, plan: LaunchPlan) -> None:
        """Modal's hello with this machine's token: a rejected token fails here, before anything is written."""
        import modal

        self._call("checking the Modal token", lambda: modal.Client.from_env().hello())

    def launch(self, plan: LaunchPlan, journal: Journal) -> list[ReplicaHandle]:
        handles = []
        for index, spec in enumerate(plan.replicas):
            what = f"starting replica {spec.rank} on Modal"
            try:
                # Modal's output (the image build, the first time) is shown for the first app only.
                handles.append(self._spawn(plan, spec.rank, journal, show_output=index == 0))
            except Exception as e:  # no retry: a second spawn could start a second replica
                refusal = classify(e, what)
                if refusal is None:
                    raise
                raise BackendError(refusal.message, 1 if refusal.transient else 2) from None
        return handles

    def _spawn(self, plan: LaunchPlan, rank: int, journal: Journal, *, show_output: bool) -> ReplicaHandle:
        """Spawn replica ``rank`` in a detached app of its own, recorded (the app) before the call exists."""
        import modal

        app = replica_module(plan.resources.get("shipped")).app

        kept: BaseException | None = None
        pending = handle = None
        output = modal.enable_output() if show_output else contextlib.nullcontext()
        role = "syncer" if rank in plan.syncer_ranks else "replica"
        with output, app.run(detach=True, name=f"{plan.run_id} {role} {rank}"):
            try:
                pending = journal.launching(rank, {"app_id": app.app_id or "", "own_app": "true"})
                call = self._function(plan, rank).spawn(plan.run_url, rank)
                handle = dataclasses.replace(
                    pending, backend_id=call.object_id, log=f"modal call {call.object_id}"
                )
                journal.launched(handle)
            except BaseException as e:  # app.run would swallow a KeyboardInterrupt: keep it for after
                kept = e
        if kept is not None:
            if pending is None and app.app_id:  # an app nobody recorded: it holds no call; do not leave it
                with contextlib.suppress(Exception):
                    _stop_app(app.app_id)
            raise kept
        assert handle is not None
        return handle

    def _function(self, plan: LaunchPlan, rank: int) -> Any:
        """The function of ``rank`` (the replica's, or the syncer's) with this run's options, made inside the
        running app that is to hold the call: a ``with_options`` variant binds to the app running when it is
        first used and stays bound, so one made once for every replica would put them all in the first
        replica's app. Its secrets are made here too, for the same reason (a secret made from a dict belongs
        to the app it is first used in)."""
        import modal

        module = replica_module(plan.resources.get("shipped"))
        res = plan.resources
        (spec,) = (s for s in plan.replicas if s.rank == rank)
        secrets = [modal.Secret.from_name(name) for name in res["modal_secrets"]]
        if spec.secrets:
            secrets.insert(0, modal.Secret.from_dict(launch_secrets(spec.secrets, self.run_secrets)))
        common = {
            "timeout": res["timeout_s"],
            "retries": modal.Retries(
                max_retries=res["retries"], initial_delay=RETRY_DELAY_S, backoff_coefficient=1.0
            ),
            "secrets": secrets,
            "env": dict(spec.env),
        }
        if rank in plan.syncer_ranks:
            syncer = res["syncer"]
            return module.syncer.with_options(cpu=syncer["cpu"], memory=syncer["memory_mb"], **common)
        return module.train_replica.with_options(gpu=res["gpu"], **common)

    def status(self, handles: list[ReplicaHandle]) -> list[ReplicaStatus]:
        statuses = []
        for handle in handles:
            if not handle.created:
                detail = (
                    "the launcher stopped while spawning it, before its call id was recorded; "
                    f"cancelling the run stops its app {handle.meta.get('app_id')}"
                )
                statuses.append(ReplicaStatus(handle.rank, "failed", None, detail))
                continue
            state, detail = self._call(f"asking Modal about replica {handle.rank}", lambda h=handle: _poll(h))
            statuses.append(ReplicaStatus(handle.rank, state, 0 if state == "succeeded" else None, detail))
        return statuses

    def logs(self, handle: ReplicaHandle, follow: bool = False, tail: int | None = None) -> Iterator[str]:
        """The call's log as whole lines (Modal's entries are chunks of output; a line may span several)."""
        import modal

        if not handle.created:
            raise FileNotFoundError(f"replica {handle.rank}'s call id was never recorded: it has no log here")
        call = modal.FunctionCall.from_id(handle.backend_id)
        what = f"reading the log of replica {handle.rank}"
        if tail is not None:
            wanted = tail * TAIL_ENTRIES_PER_LINE
            entries = self._call(what, lambda: [e.message for e in call.logs.tail(entries=wanted)])
            lines = list(whole_lines(entries))
            # A window that did not reach the start of the log may begin in the middle of a line.
            yield from (lines[1:] if len(entries) >= wanted else lines)[-tail:]
            return
        if follow:
            # Not retried here: the client's stream already retries a dropped connection from where it was.
            try:
                yield from whole_lines(entry.message for entry in call.logs.stream())
            except Exception as e:
                refusal = classify(e, what)
                if refusal is None:
                    raise
                raise BackendError(refusal.message, 1 if refusal.transient else 2) from None
            return
        yield from whole_lines(self._call(what, lambda: [e.message for e in call.logs.fetch()]))

    def cancel(self, handles: list[ReplicaHandle]) -> None:
        """Cancel each call and stop the app that holds it (which also ends a call whose id was never
        recorded); calls and apps that have already ended are left alone."""
        for handle in handles:
            if handle.created:
                self._call(f"cancelling replica {handle.rank}", lambda h=handle: _cancel_call(h.backend_id))
            app_id = handle.meta.get("app_id")
            if app_id and handle.meta.get("own_app") == "true":
                self._call(f"stopping the app of replica {handle.rank}", lambda a=app_id: _stop_app(a))

    def cancel_run(self, record: LaunchRecord) -> None:
        self.cancel(list(record.handles))


def whole_lines(chunks: Iterable[str]) -> Iterator[str]:
    """The lines of the text ``chunks`` make when joined, without their line ends; a last line without one is
    given at the end."""
    partial = ""
    for chunk in chunks:
        *complete, partial = (partial + chunk).split("\n")
        yield from (line.rstrip("\r") for line in complete)
    if partial:
        yield partial.rstrip("\r")


def _poll(handle: ReplicaHandle) -> tuple[ReplicaState, str]:
    """(state, detail) of a call, from what ``FunctionCall.get(timeout=0)`` returns or raises."""
    import modal
    from modal import exception as mx

    try:
        modal.FunctionCall.from_id(handle.backend_id).get(timeout=0)
    except TimeoutError:  # the built-in one: no result yet (modal's own TimeoutError is not a subclass)
        return "running", ""
    except mx.OutputExpiredError:
        return "failed", "ended so long ago that Modal no longer keeps its result"
    except mx.FunctionTimeoutError as e:
        return "failed", f"timed out after its retries: {e}"
    except mx.ImageBuildError as e:
        return "failed", f"its image failed to build: {e}"
    except mx.RemoteError as e:  # a terminated result: the call was cancelled (here, the dashboard, app stop)
        return "cancelled", f"cancelled on Modal ({e})" if str(e) else "cancelled on Modal"
    except mx.NotFoundError:
        return "failed", "Modal does not know this call (any more)"
    except Exception as e:
        if classify(e, "") is not None:
            raise  # the API's, not the replica's: retried or reported by the caller
        return "failed", f"{type(e).__name__}: {e}"  # the replica's own, after Modal's retries
    return "succeeded", ""


def _cancel_call(call_id: str) -> None:
    import modal
    from modal import exception as mx

    with contextlib.suppress(mx.NotFoundError):  # gone already
        modal.FunctionCall.from_id(call_id).cancel(terminate_containers=True)


def _stop_app(app_id: str) -> None:
    import modal
    from modal import exception as mx

    with contextlib.suppress(mx.NotFoundError):  # gone already
        modal.App.lookup(app_id).stop()


def replica_module(shipped: dict[str, Any] | None) -> Any:
    """``modal_app``, its image holding the run's code and requirements: imported again when the shipment
    differs from the one its image was built with (a module-level app cannot change its image later). A plan
    written before runs shipped code (resumed) has none."""
    from composer_serverless.executors import modal_app

    wanted = shipped if shipped and (shipped["code"] or shipped["requirements"]) else None
    if wanted != modal_app.SHIPPED:
        os.environ[SHIPMENT_ENV] = json.dumps(wanted)
        try:
            modal_app = importlib.reload(modal_app)
        finally:
            del os.environ[SHIPMENT_ENV]
    return modal_app


def _syncer_resources(config: RunConfig) -> dict[str, Any] | None:
    ex = config.executor
    return syncer_resources(
        config,
        function="syncer",
        gpu=None,
        cpu=ex.syncer_cpu,
        memory_mb=ex.syncer_memory_mb,
        hardware=f"Modal CPU function, {ex.syncer_cpu:g} cores, {ex.syncer_memory_mb} MiB, no GPU",
    )


def _syncer_cost(config: RunConfig) -> CostEstimate:
    """The syncer's cores and memory at Modal's per-second CPU and memory rates, per shard."""
    ex = config.executor
    gib = ex.syncer_memory_mb / 1024
    price = ex.syncer_cpu * MODAL_CPU_CORE_PRICE + gib * MODAL_MEMORY_GIB_PRICE
    basis = (
        f"Modal list prices: {ex.syncer_cpu:g} cores x ${MODAL_CPU_CORE_PRICE}/core-hour + {gib:g} GiB x "
        f"${MODAL_MEMORY_GIB_PRICE}/GiB-hour"
    )
    return estimate_cost(
        config, price_per_replica_hour=price, price_basis=basis, gpus_per_replica=0, of="syncer"
    )


def _gpu_option(gpu: str, count: int) -> str:
    return gpu if count == 1 else f"{gpu}:{count}"
