"""``HFJobsExecutor``: one Hugging Face Job per replica, through ``huggingface_hub``'s Jobs API.

What the Jobs API teaches (see the project's research notes on HF Jobs):

* Every call gets an explicit ``namespace``. Without one the client first asks ``/api/whoami-v2``, the Hub's
  most strictly rate-limited endpoint, on every call; ``list_jobs`` without one even ignores the client's
  token and endpoint. The namespace comes from the config or is resolved once at launch and stored in the
  handles.
* Status costs one labelled ``list_jobs`` call per poll for all replicas, not one ``inspect_job`` per
  replica. Every job is labelled with the run, its rank and its attempt, so a job is found even before its
  id is recorded. A listing can miss a live job: a job it leaves out is inspected by id before anything is
  concluded, because taking it for dead would start a second one beside it.
* Every job gets an explicit timeout (the server's default, 30 minutes, would cut a run short).
* Secrets (the Hub token, the store's credentials) go in the job's ``secrets``, read by name from this
  environment when the jobs are created; they never appear in the command, the plan or a log.
* A job can sit in SCHEDULING for hours when hardware is short. Past ``scheduling_deadline_s`` it is
  reported ``unscheduled``; the launcher cancels it and the run goes on without it.
* Cancelling a job that has already ended is answered with a 4xx, which is not an error here.
* The API's refusals are the user's to fix (401 token, 402 credits, 403 permissions, 404 namespace, or job
  for a log: exit 2)
  or transient (429, 5xx, the network: retried, honouring ``Retry-After``, then exit 1). Creating a job is
  retried only after a failure that shows nothing was created (no connection made, a 429); after another
  one (no answer in time, a 5xx) a labelled listing is asked once, and if it shows no job the launch stops
  rather than risk a second job beside one the listing missed.
* Logs are for people: progress and outcome come from the store and the job's stage, never from a log
  stream (streams stall and drop lines).

In decoupled mode the syncer (the rank after the learners') is one more job of the run, labelled and
watched like the replicas, on a CPU flavor (``executor.syncer_flavor``): it merges in host memory. With
``diloco.decoupled.syncer_shards`` it is one such job per shard, each with a rank of its own.

The replica command is the same worker as everywhere, run by the image's ``python``; with
``executor.package`` set the job first pip-installs that requirement (a stock PyTorch image plus the
package pinned to a commit), otherwise the image must already contain it (deploy/hf_jobs/Dockerfile).
"""

from __future__ import annotations

import dataclasses
import logging
import shlex
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from composer_serverless.accelerator import ACCELERATOR_ENV
from composer_serverless.config import DEFAULT_HF_JOBS_IMAGE, RunConfig
from composer_serverless.config.hardware import HF_FLAVOR_PRICES
from composer_serverless.executors import retrying, runtime, shipment
from composer_serverless.executors.base import (
    BackendError,
    CostEstimate,
    Journal,
    LaunchPlan,
    LaunchRecord,
    ReplicaHandle,
    ReplicaSpec,
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
    secret_value,
)
from composer_serverless.executors.hf_errors import classify, is_gone, nothing_done
from composer_serverless.executors.pricing import estimate_cost
from composer_serverless.executors.runtime import torch_build

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
_TERMINAL_STAGES = frozenset({"COMPLETED", "CANCELED", "ERROR", "DELETED"})
# How often cancel lists the run again to see its jobs end, and for how long.
CANCEL_CHECKS = 5
CANCEL_CHECK_S = 1.0
T = TypeVar("T")


class HFJobsExecutor:
    name = "hf_jobs"

    def __init__(self, api: HfApi | None = None, retry_s: float = 60.0) -> None:
        self._api_instance = api
        self._retry_s = retry_s
        self.run_secrets: dict[str, str] = {}

    @property
    def _api(self) -> HfApi:
        if self._api_instance is None:
            from huggingface_hub import HfApi

            self._api_instance = HfApi(token=secret_value(HUB_TOKEN))
        return self._api_instance

    def _call(self, what: str, fn: Callable[[], T], namespace: str | None = None) -> T:
        return retrying.call(
            fn,
            lambda e: classify(e, what, namespace, self._api.endpoint),
            budget_s=self._retry_s,
            what=what,
        )

    def plan(self, config: RunConfig, run_url: str) -> LaunchPlan:
        ex = config.executor
        replicas = config.diloco.replicas
        check_cloud_plan(config, "HF Jobs", at_once=f"{replicas} {ex.flavor} jobs")
        env = cloud_env()
        if ex.gpus:  # a GPU flavor: its replicas must find the GPUs (a cpu-* flavor trains on the CPU)
            env[ACCELERATOR_ENV] = "cuda"
        secrets = present_secrets(config, always=(HUB_TOKEN,))
        stock = ex.image == DEFAULT_HF_JOBS_IMAGE
        shipped = shipment.plan(config, cloud=True)
        ranks = [(rank, env) for rank in range(replicas)]
        # The syncer's shards, on a CPU flavor: no accelerator to find
        ranks += [(rank, cloud_env()) for rank in config.diloco.syncer_ranks]
        syncer = syncer_resources(config, flavor=ex.syncer_flavor, hardware=f"HF Jobs {ex.syncer_flavor}")
        specs = tuple(
            ReplicaSpec(
                rank,
                _command(run_url, rank, ex.package, install_torch=stock, requirements=shipped.requirements),
                rank_env,
                secrets,
            )
            for rank, rank_env in ranks
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
            syncer_cost=None if syncer is None else _syncer_cost(config),
            resources={
                "syncer": syncer,
                "image": ex.image,
                # The stock image gets the tested torch build installed at start; an image of your own
                # runs the torch it holds.
                "torch": torch_build() if stock else f"as installed in {ex.image}",
                "package": ex.package,
                "shipped": shipped.describe(shipment.STORE),
                "flavor": ex.flavor,
                "timeout_s": ex.timeout_s,
                "namespace": ex.namespace,
                "labels": {"run_id": config.run_id or "", "rank": "<rank>", "attempt": "<attempt>"},
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
                "executor.package is not set\n  fix: --set executor.package='composer-serverless[s3,hf,parquet] @ "
                "https://github.com/<you>/composer-serverless/archive/<commit>.tar.gz' (code you pushed), or "
                "build deploy/hf_jobs/Dockerfile, push it, and --set executor.image=<that image>"
            )
        return problems

    def check_access(self, plan: LaunchPlan) -> None:
        """One labelled listing in the namespace: a rejected token (401), a namespace the token may not use
        (403) or that does not exist (404) fails here, before the run is written to the store."""
        namespace = self._namespace(plan)
        self._jobs(namespace, {"run_id": plan.run_id}, "checking access to HF Jobs")

    def _namespace(self, plan: LaunchPlan) -> str:
        namespace = plan.resources["namespace"]
        if namespace:
            return namespace
        return self._call("finding your Hub user name", lambda: self._api.whoami(cache=True)["name"])

    def launch(self, plan: LaunchPlan, journal: Journal) -> list[ReplicaHandle]:
        res = plan.resources
        namespace = self._namespace(plan)
        handles: list[ReplicaHandle] = []
        for spec in plan.replicas:
            meta = {
                "namespace": namespace,
                "run_id": plan.run_id,
                "launched_at": f"{time.time():.3f}",
                "scheduling_deadline_s": str(res["scheduling_deadline_s"]),
            }
            pending = journal.launching(spec.rank, meta)
            job = self._create(plan, spec, namespace, _labels(pending))
            handle = dataclasses.replace(pending, backend_id=job.id, log=job.url)
            journal.launched(handle)
            handles.append(handle)
        return handles

    def _create(self, plan: LaunchPlan, spec: ReplicaSpec, namespace: str, labels: dict[str, str]) -> Any:
        """``run_job`` for one attempt, retried only after a failure that shows it created nothing
        (``nothing_done``). After any other failure the job may exist, and a listing can miss a live job, so
        the request is not sent again: one labelled listing is asked, a job it shows is the attempt's, and if
        it shows none the launch stops (``launch --resume`` ends such a job, found by its labels, before it
        starts the replicas again)."""
        res = plan.resources
        what = f"creating the job of replica {spec.rank}"

        def create() -> Any:
            try:
                return self._api.run_job(
                    image=res["image"],
                    command=list(spec.command),
                    env=dict(spec.env),
                    secrets=launch_secrets(spec.secrets, self.run_secrets),
                    flavor=_flavor(plan, spec.rank),
                    timeout=res["timeout_s"],
                    labels=labels,
                    name=f"{plan.run_id}-r{labels['rank']}-a{labels['attempt']}",
                    namespace=namespace,
                )
            except Exception as e:
                refusal = classify(e, what, namespace, self._api.endpoint)
                if refusal is not None and refusal.transient and not nothing_done(e):
                    raise _MaybeCreated(refusal.message.splitlines()[0]) from e
                raise

        try:
            return self._call(what, create, namespace)
        except _MaybeCreated as e:
            cause = str(e)
        created = self._jobs(namespace, labels, "looking for the job a failed request may have created")
        if created:
            return created[0]
        raise BackendError(
            f"{cause}; the request may still have created the job, and no listing shows it yet, so it is not "
            "sent again (a second job could run beside it)\n"
            f"  fix: once the Hub answers again, composer-serverless launch --resume {plan.run_url} (it first "
            "ends any job this attempt created, found by its labels)",
            1,
        )

    def _jobs(self, namespace: str, labels: dict[str, str], what: str) -> list[Any]:
        return self._call(
            what, lambda: list(self._api.list_jobs(namespace=namespace, labels=labels)), namespace
        )

    def _inspect(self, handle: ReplicaHandle) -> Any | None:
        """The job of ``handle`` asked for by id, or None if the Hub no longer knows it."""
        from huggingface_hub.errors import HfHubHTTPError

        namespace = handle.meta["namespace"]

        def inspect() -> Any | None:
            try:
                return self._api.inspect_job(job_id=handle.backend_id, namespace=namespace)
            except HfHubHTTPError as e:
                if is_gone(e):
                    return None
                raise

        return self._call(f"asking for job {handle.backend_id}", inspect, namespace)

    def status(self, handles: list[ReplicaHandle]) -> list[ReplicaStatus]:
        if not handles:
            return []
        meta = handles[0].meta
        jobs = self._jobs(meta["namespace"], {"run_id": meta["run_id"]}, "listing the run's jobs")
        by_id = {job.id: job for job in jobs}
        by_attempt = {_attempt_of(job): job for job in jobs}
        statuses = []
        for handle in handles:
            if handle.created:
                job = by_id.get(handle.backend_id)
                if job is None:  # a listing can leave a live job out: ask for it by id before concluding
                    job = self._inspect(handle)
                statuses.append(_status(handle, job))
            else:
                job = by_attempt.get((str(handle.rank), str(handle.attempt)))
                statuses.append(_status(handle, job) if job is not None else _never_created(handle))
        return statuses

    def logs(self, handle: ReplicaHandle, follow: bool = False, tail: int | None = None) -> Iterator[str]:
        """The job's log lines. A transient failure before the stream ends is retried by reading the log
        again and skipping the lines already given (the server replays it from the start)."""
        job_id = handle.backend_id or self._job_id_of(handle)
        namespace = handle.meta["namespace"]
        what = f"reading the log of replica {handle.rank}"
        backoff = retrying.Backoff(self._retry_s, what)
        given = 0
        while True:
            try:
                lines = self._api.fetch_job_logs(job_id=job_id, namespace=namespace, follow=follow, tail=tail)
                for index, line in enumerate(lines):
                    if index >= given:
                        given += 1
                        yield line
                backoff.succeeded()
                return
            except Exception as e:
                refusal = classify(e, what, namespace, self._api.endpoint, job=job_id)
                if refusal is None:
                    raise
                backoff.wait(refusal)

    def _job_id_of(self, handle: ReplicaHandle) -> str:
        labels = _labels(handle)
        found = self._jobs(handle.meta["namespace"], labels, "finding the job of an attempt")
        if not found:
            raise FileNotFoundError(
                f"replica {handle.rank}'s attempt {handle.attempt} was being created when the launcher stopped, "
                "and no job carries its labels: it has no log"
            )
        return found[0].id

    def cancel(self, handles: list[ReplicaHandle]) -> None:
        """Cancel these attempts: by id, or by their labels when the id was never recorded."""
        if not handles:
            return
        meta = handles[0].meta
        wanted = {(str(h.rank), str(h.attempt)) for h in handles}
        self._cancel_where(
            meta["namespace"],
            meta["run_id"],
            {h.backend_id for h in handles if h.created},
            lambda job: _attempt_of(job) in wanted,
        )

    def cancel_run(self, record: LaunchRecord) -> None:
        """Cancel every job labelled with the run, every attempt, and every job the record names by id."""
        if not record.handles:
            return
        meta = record.handles[0].meta
        ids = {h.backend_id for h in record.handles if h.created}
        self._cancel_where(meta["namespace"], meta["run_id"], ids, lambda job: True)

    def _cancel_where(
        self, namespace: str, run_id: str, ids: set[str], chosen: Callable[[Any], bool]
    ) -> None:
        """Cancel the run's listed jobs that ``chosen`` picks and the jobs ``ids`` name, until a listing
        shows none of them running (a few checks, a second apart)."""
        asked: set[str] = set()
        for check in range(CANCEL_CHECKS):
            jobs = self._jobs(namespace, {"run_id": run_id}, "listing the run's jobs to cancel them")
            live = {
                job.id
                for job in jobs
                if _stage(job) not in _TERMINAL_STAGES and (job.id in ids or chosen(job))
            }
            unlisted = ids - {job.id for job in jobs} - asked  # a listing may leave a job out: cancel by id
            if not live and not unlisted:
                return
            for job_id in sorted(live | unlisted):
                self._cancel_job(namespace, job_id)
                asked.add(job_id)
            if check + 1 < CANCEL_CHECKS:
                time.sleep(CANCEL_CHECK_S)
        logger.warning("jobs of run %s were asked to cancel but still listed as running", run_id)

    def _cancel_job(self, namespace: str, job_id: str) -> None:
        from huggingface_hub.errors import HfHubHTTPError

        def cancel() -> None:
            try:
                self._api.cancel_job(job_id=job_id, namespace=namespace)
            except HfHubHTTPError as e:  # a job that has already ended cannot be cancelled; that is fine
                if not is_gone(e):
                    raise
                logger.info("job %s not cancelled: %s", job_id, e)

        self._call(f"cancelling job {job_id}", cancel, namespace)


class _MaybeCreated(Exception):
    """A job creation failed in a way that does not show whether the job was created (its message: why)."""


def _command(
    run_url: str, rank: int, package: str | None, *, install_torch: bool, requirements: tuple[str, ...] = ()
) -> tuple[str, ...]:
    """The job's command: the worker, after installing the tested torch build (on the stock image), the
    package (when ``executor.package`` names one) and the run's code's requirements."""
    worker = worker_argv(run_url, rank)
    steps = [runtime.install_torch()] if install_torch else []
    if package is not None:
        steps.append(f"pip install --quiet --no-cache-dir {shlex.quote(package)}")
    if requirements:
        steps.append("pip install --quiet --no-cache-dir " + " ".join(map(shlex.quote, requirements)))
    if not steps:
        return worker
    return ("bash", "-c", " && ".join([*steps, f"exec {shlex.join(worker)}"]))


def _flavor(plan: LaunchPlan, rank: int) -> str:
    """The flavor of ``rank``'s job: the syncer's CPU flavor for a shard of the syncer, else the replicas'."""
    return plan.resources["syncer"]["flavor"] if rank in plan.syncer_ranks else plan.resources["flavor"]


def _syncer_cost(config: RunConfig) -> CostEstimate:
    flavor = config.executor.syncer_flavor
    price = HF_FLAVOR_PRICES[flavor]
    basis = f"HF Jobs list price of {flavor}"
    return estimate_cost(
        config, price_per_replica_hour=price, price_basis=basis, gpus_per_replica=0, of="syncer"
    )


def _labels(handle: ReplicaHandle) -> dict[str, str]:
    return {"run_id": handle.meta["run_id"], "rank": str(handle.rank), "attempt": str(handle.attempt)}


def _attempt_of(job: Any) -> tuple[str, str]:
    labels = job.labels or {}
    return labels.get("rank", ""), labels.get("attempt", "")


def _stage(job: Any) -> str:
    stage = job.status.stage
    return str(getattr(stage, "value", stage))


def _never_created(handle: ReplicaHandle) -> ReplicaStatus:
    return ReplicaStatus(
        handle.rank,
        "failed",
        None,
        "its launch was interrupted before a job was created (no job has its labels)",
    )


def _status(handle: ReplicaHandle, job: Any) -> ReplicaStatus:
    if job is None:
        return ReplicaStatus(
            handle.rank, "failed", None, f"job {handle.backend_id} is gone (the Hub does not know it)"
        )
    stage, message = _stage(job), job.status.message or ""
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
