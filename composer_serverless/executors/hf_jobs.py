"""``HFJobsExecutor``: one Hugging Face Job per replica, through ``huggingface_hub``'s Jobs API.

What the Jobs API teaches (see the project's research notes on HF Jobs):

* Every call gets an explicit ``namespace``. Without one the client first asks ``/api/whoami-v2``, the Hub's
  most strictly rate-limited endpoint, on every call; ``list_jobs`` without one even ignores the client's
  token and endpoint. The namespace comes from the config or is resolved once at launch and stored in the
  handles.
* Status costs one labelled ``list_jobs`` call per poll for all replicas (labels ``run_id`` and ``rank``),
  not one ``inspect_job`` per replica.
* Every job gets an explicit timeout (the server's default, 30 minutes, would cut a run short).
* Secrets (the Hub token, the store's credentials) go in the job's ``secrets``, read by name from this
  environment when the jobs are created; they never appear in the command, the plan or a log.
* A job can sit in SCHEDULING for hours when hardware is short. Past ``scheduling_deadline_s`` it is
  reported ``unscheduled``; the launcher cancels it and the run goes on without it.
* Logs are for people: progress and outcome come from the store and the job's stage, never from a log
  stream (streams stall and drop lines).

The replica command is the same worker as everywhere, run by the image's ``python``; with
``executor.package`` set the job first pip-installs that requirement (a stock PyTorch image plus the
package pinned to a commit), otherwise the image must already contain it (deploy/hf_jobs/Dockerfile).
"""

from __future__ import annotations

import logging
import shlex
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from composer_serverless.config import DEFAULT_HF_JOBS_IMAGE, RunConfig
from composer_serverless.config.hardware import HF_FLAVOR_PRICES
from composer_serverless.executors.base import (
    LaunchPlan,
    ReplicaHandle,
    ReplicaSpec,
    ReplicaStatus,
    worker_argv,
)
from composer_serverless.executors.environment import (
    check_cloud_plan,
    cloud_env,
    launch_secrets,
    present_secrets,
    secret_name_problems,
    secret_value,
)
from composer_serverless.executors.pricing import estimate_cost

if TYPE_CHECKING:
    from huggingface_hub import HfApi

logger = logging.getLogger(__name__)

HUB_TOKEN = "HF_TOKEN"
_STAGES = {
    "RUNNING": "running",
    "COMPLETED": "succeeded",
    "CANCELED": "cancelled",
    "ERROR": "failed",
    "DELETED": "failed",
}


class HFJobsExecutor:
    name = "hf_jobs"

    def __init__(self, api: HfApi | None = None) -> None:
        self._api_instance = api
        self.run_secrets: dict[str, str] = {}

    @property
    def _api(self) -> HfApi:
        if self._api_instance is None:
            from huggingface_hub import HfApi

            self._api_instance = HfApi(token=secret_value(HUB_TOKEN))
        return self._api_instance

    def plan(self, config: RunConfig, run_url: str) -> LaunchPlan:
        ex = config.executor
        replicas = config.diloco.replicas
        check_cloud_plan(config, "HF Jobs", at_once=f"{replicas} {ex.flavor} jobs")
        env = cloud_env()
        secrets = present_secrets(config, always=(HUB_TOKEN,))
        specs = tuple(
            ReplicaSpec(rank, _command(run_url, rank, ex.package), env, secrets) for rank in range(replicas)
        )
        price = ex.price_per_hour or HF_FLAVOR_PRICES[ex.flavor]
        basis = "executor.price_per_hour" if ex.price_per_hour else f"HF Jobs list price of {ex.flavor}"
        return LaunchPlan(
            executor=self.name,
            run_id=config.run_id or "",
            run_url=run_url,
            replicas=specs,
            cost=estimate_cost(
                config, price_per_replica_hour=price, price_basis=basis, gpus_per_replica=ex.gpus
            ),
            resources={
                "image": ex.image,
                "package": ex.package,
                "flavor": ex.flavor,
                "timeout_s": ex.timeout_s,
                "namespace": ex.namespace,
                "labels": {"run_id": config.run_id or "", "rank": "<rank>"},
                "scheduling_deadline_s": ex.scheduling_deadline_s,
            },
            ranks_per_replica=config.ranks_per_replica,
            launcher_restarts=ex.max_restarts,
        )

    def preflight(self, plan: LaunchPlan) -> list[str]:
        problems = secret_name_problems(plan.replicas[0].secrets)
        if plan.resources["image"] == DEFAULT_HF_JOBS_IMAGE and plan.resources["package"] is None:
            problems.append(
                f"the stock image {DEFAULT_HF_JOBS_IMAGE} does not contain composer-serverless, and "
                "executor.package is not set\n  fix: --set executor.package='composer-serverless[s3,hf] @ "
                "https://github.com/<you>/composer-serverless/archive/<commit>.tar.gz' (code you pushed), or "
                "build deploy/hf_jobs/Dockerfile, push it, and --set executor.image=<that image>"
            )
        return problems

    def launch(self, plan: LaunchPlan) -> list[ReplicaHandle]:
        res = plan.resources
        namespace = res["namespace"] or self._api.whoami(cache=True)["name"]
        handles: list[ReplicaHandle] = []
        try:
            for spec in plan.replicas:
                job = self._api.run_job(
                    image=res["image"],
                    command=list(spec.command),
                    env=dict(spec.env),
                    secrets=launch_secrets(spec.secrets, self.run_secrets),
                    flavor=res["flavor"],
                    timeout=res["timeout_s"],
                    labels={"run_id": plan.run_id, "rank": str(spec.rank)},
                    name=f"{plan.run_id}-r{spec.rank}",
                    namespace=namespace,
                )
                meta = {
                    "namespace": namespace,
                    "run_id": plan.run_id,
                    "launched_at": f"{time.time():.3f}",
                    "scheduling_deadline_s": str(res["scheduling_deadline_s"]),
                }
                handles.append(ReplicaHandle(spec.rank, job.id, job.url, meta=meta))
        except BaseException:
            self.cancel(handles)  # never leave half a run billing
            raise
        return handles

    def status(self, handles: list[ReplicaHandle]) -> list[ReplicaStatus]:
        if not handles:
            return []
        meta = handles[0].meta
        jobs = {
            job.id: job
            for job in self._api.list_jobs(namespace=meta["namespace"], labels={"run_id": meta["run_id"]})
        }
        return [_status(handle, jobs.get(handle.backend_id)) for handle in handles]

    def logs(self, handle: ReplicaHandle, follow: bool = False) -> Iterator[str]:
        yield from self._api.fetch_job_logs(
            job_id=handle.backend_id, namespace=handle.meta["namespace"], follow=follow
        )

    def cancel(self, handles: list[ReplicaHandle]) -> None:
        from huggingface_hub.errors import HfHubHTTPError

        for handle in handles:
            try:
                self._api.cancel_job(job_id=handle.backend_id, namespace=handle.meta["namespace"])
            except HfHubHTTPError as e:  # a job that has already ended cannot be cancelled; that is fine
                logger.info("replica %d (job %s) not cancelled: %s", handle.rank, handle.backend_id, e)


def _command(run_url: str, rank: int, package: str | None) -> tuple[str, ...]:
    worker = worker_argv(run_url, rank)
    if package is None:
        return worker
    install = f"pip install --quiet --no-cache-dir {shlex.quote(package)}"
    return ("bash", "-c", f"{install} && exec {shlex.join(worker)}")


def _status(handle: ReplicaHandle, job: Any) -> ReplicaStatus:
    if job is None:
        return ReplicaStatus(handle.rank, "failed", None, f"job {handle.backend_id} is not listed any more")
    stage, message = str(job.status.stage), job.status.message or ""
    if stage == "SCHEDULING":
        waited = time.time() - float(handle.meta["launched_at"])
        deadline = float(handle.meta["scheduling_deadline_s"])
        if waited > deadline:
            reason = f": {message}" if message else ""
            detail = f"still SCHEDULING after {waited:.0f} s (deadline {deadline:g} s){reason}"
            return ReplicaStatus(handle.rank, "unscheduled", None, detail)
        return ReplicaStatus(handle.rank, "pending", None, message or "waiting for hardware")
    state = _STAGES.get(stage)
    if state is None:
        return ReplicaStatus(handle.rank, "pending", None, f"stage {stage}")
    exit_code = 0 if state == "succeeded" else None
    return ReplicaStatus(handle.rank, state, exit_code, message or stage.lower())
