"""The executor protocol: how a launch plan becomes N running replicas on some backend.

Plans and handles are frozen, JSON-serialisable values. A plan (what will be started, with what resources,
at what estimated cost) is built and tested without any network; handles (how to find a started replica
again) are stored in the run as ``launch.json``, so any process holding the run URL can watch, read the logs
of, or cancel the replicas: the launcher may detach or die without orphaning them.

Every replica is recorded before it can bill: an executor tells its ``Journal`` that it is about to create
an attempt (a handle with no backend id yet, and what finds the attempt without one: its job labels, its
Modal app, its command line), then creates it, then records its id. A launcher killed between the two
leaves an attempt that ``cancel_run`` still finds.

Secrets appear here only by name: a spec lists the environment variables whose values reach the replica as
secrets, and each backend reads the values from the launcher's environment at the moment it launches.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from composer_serverless.config import RunConfig

WORKER_MODULE = "composer_serverless.replicas.worker"

ReplicaState = Literal["pending", "running", "succeeded", "failed", "cancelled", "unscheduled"]
TERMINAL_STATES: frozenset[str] = frozenset({"succeeded", "failed", "cancelled", "unscheduled"})


def worker_argv(run_url: str, rank: int, python: str = "python") -> tuple[str, ...]:
    """The replica command every backend runs; backends differ only in where ``python`` lives."""
    return (python, "-u", "-m", WORKER_MODULE, "--run", run_url, "--rank", str(rank))


@dataclass(frozen=True)
class ReplicaSpec:
    """One replica to start: its command, its non-secret environment, and the names of its secrets."""

    rank: int
    command: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    secrets: tuple[str, ...] = ()


@dataclass(frozen=True)
class CostEstimate:
    """What a plan may cost, in USD, from a list price per replica-hour.

    ``max_usd`` is a bound, not a guess: every replica runs to its timeout and uses every restart.
    ``expected_usd`` needs a step time, ``executor.seconds_per_step`` or one the project measured on the same
    GPU for the same model size and workload (``executors/measured.py``; ``expected_basis`` says which), and
    counts start-up plus the configured inner steps once per replica; it leaves out sync waits and restarts.
    ``of`` says whose cost it is: the replicas' (``diloco.replicas`` of them), or the decoupled syncer's (its
    ``shards`` CPU machines, ``diloco.decoupled.syncer_shards``, each running as long as the learners do; the
    "replica-hours" fields then count their hours, all shards together).
    """

    price_per_replica_hour: float
    price_basis: str
    gpus_per_replica: int
    max_replica_hours: float
    max_usd: float
    expected_replica_hours: float | None = None
    expected_usd: float | None = None
    expected_basis: str | None = None
    of: Literal["replica", "syncer"] = "replica"
    shards: int = 1

    def summary(self) -> str:
        if self.price_per_replica_hour == 0:
            return f"$0 ({self.price_basis})"
        of = self.of if self.shards == 1 else f"{self.of}-shard"
        expected = (
            f"expected ${self.expected_usd:,.2f} ({self.expected_replica_hours:,.2f} {of}-hours; "
            f"{self.expected_basis})"
            if self.expected_usd is not None
            else "expected: no step time measured for this GPU, model size and workload (set "
            "executor.seconds_per_step to estimate)"
        )
        if self.of == "replica":
            every = "every replica"
        else:
            every = "the syncer" if self.shards == 1 else f"each of the syncer's {self.shards} shards"
        return (
            f"{expected}; at most ${self.max_usd:,.2f} ({self.max_replica_hours:,.2f} {of}-hours, {every} "
            f"to its timeout with every restart) at ${self.price_per_replica_hour:,.2f}/{of}-hour "
            f"({self.price_basis})"
        )


@dataclass(frozen=True)
class LaunchPlan:
    """Everything an executor will start for a run, decided before anything is started.

    ``launcher_restarts`` is how often the launcher may start a dead replica again; backends that retry by
    themselves (Modal) get 0 here and their retries in ``resources``. ``model`` says what the replicas load,
    with the opt-ins that matter before paying for them (``trust_remote_code`` runs the checkpoint's code).
    ``ranks_per_replica`` is how many processes (one per GPU, when there are GPUs) shard each replica's model.
    In decoupled mode ``replicas`` ends with the syncer's shards (ranks ``diloco.syncer_ranks``, one process
    each, ``diloco.decoupled.syncer_shards`` of them), so launch, status, restart and cancel cover every shard
    as they cover a replica; ``resources["syncer"]`` says their hardware (``syncer_resources``) and
    ``syncer_cost`` what they cost together beside the replicas' ``cost``.
    """

    executor: str
    run_id: str
    run_url: str
    replicas: tuple[ReplicaSpec, ...]
    cost: CostEstimate
    resources: dict[str, Any] = field(default_factory=dict)
    launcher_restarts: int = 0
    model: dict[str, Any] = field(default_factory=dict)
    ranks_per_replica: int = 1
    syncer_cost: CostEstimate | None = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LaunchPlan:
        replicas = tuple(
            ReplicaSpec(r["rank"], tuple(r["command"]), dict(r["env"]), tuple(r["secrets"]))
            for r in data["replicas"]
        )
        return cls(
            executor=data["executor"],
            run_id=data["run_id"],
            run_url=data["run_url"],
            replicas=replicas,
            cost=CostEstimate(**data["cost"]),
            resources=data["resources"],
            launcher_restarts=data["launcher_restarts"],
            model=data.get("model", {}),
            ranks_per_replica=data.get("ranks_per_replica", 1),
            syncer_cost=CostEstimate(**data["syncer_cost"]) if data.get("syncer_cost") else None,
        )

    def only(self, ranks: Collection[int]) -> LaunchPlan:
        """The same plan restricted to the replicas of ``ranks``: what a relaunch of them starts."""
        return dataclasses.replace(self, replicas=tuple(s for s in self.replicas if s.rank in ranks))

    @property
    def syncer_ranks(self) -> tuple[int, ...]:
        """The ranks of the decoupled syncer's shards (none in lock-step mode)."""
        syncer = self.resources.get("syncer")
        if syncer is None:
            return ()
        return tuple(syncer.get("ranks", (syncer["rank"],)))

    def syncer_hardware(self) -> str:
        """Where the syncer runs, for people: its hardware, and with several shards their count and ranks."""
        syncer = self.resources["syncer"]
        ranks = self.syncer_ranks
        if len(ranks) == 1:
            return syncer["hardware"]
        return f"{len(ranks)} shards, ranks {ranks[0]}-{ranks[-1]}, each {syncer['hardware']}"


def syncer_resources(config: RunConfig, **hardware: Any) -> dict[str, Any] | None:
    """A plan's ``resources["syncer"]``: ``rank`` (its first shard's), and with several shards ``ranks`` and
    ``shards`` (one shard keeps the single syncer's shape), beside ``hardware`` (what each shard runs on,
    with its ``hardware`` line for people); None in lock-step mode, which has no syncer."""
    ranks = config.diloco.syncer_ranks
    if not ranks:
        return None
    shards = {} if len(ranks) == 1 else {"ranks": list(ranks), "shards": len(ranks)}
    return {"rank": ranks[0], **shards, **hardware}


def model_plan(config: RunConfig) -> dict[str, Any]:
    """What the replicas will load and how: the part of a plan a user checks before paying for it."""
    spec = config.model
    return {
        "path": spec.path or "the tiny model, built by the launcher",
        "revision": spec.revision,
        "trust_remote_code": spec.trust_remote_code,
        "dtype": spec.dtype,
        "master_dtype": spec.master_dtype,
        "lora": None if spec.lora is None else spec.lora.model_dump(),
    }


@dataclass(frozen=True)
class ReplicaHandle:
    """How to find a started replica again: its backend id, where its log is, and backend details.

    ``meta`` holds what a backend needs to address the replica from another process (a process's start
    time and group, a job's namespace, a Modal app id); everything in it is a string. ``backend_id`` is empty
    while the attempt is being created (recorded before the backend's create call): ``meta`` then says how
    to find it without an id.
    """

    rank: int
    backend_id: str
    log: str | None = None
    attempt: int = 1
    meta: dict[str, str] = field(default_factory=dict)

    @property
    def created(self) -> bool:
        """Whether the backend's id of the attempt is known (its create call returned)."""
        return bool(self.backend_id)


@dataclass(frozen=True)
class ReplicaStatus:
    rank: int
    state: ReplicaState
    exit_code: int | None = None
    detail: str = ""


@dataclass(frozen=True)
class LaunchRecord:
    """``launch.json``: the plan, every attempt's handle (oldest first), launch time, whether cancelled, and
    the wall time the run's earlier launches spent (a resumed run's report counts the whole run)."""

    plan: LaunchPlan
    handles: tuple[ReplicaHandle, ...]
    created_at: float = 0.0
    cancelled: bool = False
    earlier_wall_s: float = 0.0

    def current(self) -> list[ReplicaHandle]:
        """The latest attempt of each rank, in rank order."""
        latest: dict[int, ReplicaHandle] = {}
        for handle in self.handles:
            if handle.rank not in latest or handle.attempt >= latest[handle.rank].attempt:
                latest[handle.rank] = handle
        return [latest[rank] for rank in sorted(latest)]

    def with_handle(self, handle: ReplicaHandle) -> LaunchRecord:
        """The record with ``handle``: it replaces the entry of the same rank and attempt (an attempt being
        created, now created), or is added."""
        kept = tuple(h for h in self.handles if (h.rank, h.attempt) != (handle.rank, handle.attempt))
        return dataclasses.replace(self, handles=(*kept, handle))

    def next_attempt(self, rank: int) -> int:
        return 1 + max((h.attempt for h in self.handles if h.rank == rank), default=0)

    def to_json(self) -> bytes:
        payload = {
            "plan": json.loads(self.plan.to_json()),
            "handles": [dataclasses.asdict(h) for h in self.handles],
            "created_at": self.created_at,
            "cancelled": self.cancelled,
            "earlier_wall_s": self.earlier_wall_s,
        }
        return json.dumps(payload, indent=2, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> LaunchRecord:
        raw = json.loads(data)
        return cls(
            plan=LaunchPlan.from_dict(raw["plan"]),
            handles=tuple(ReplicaHandle(**h) for h in raw["handles"]),
            created_at=raw["created_at"],
            cancelled=raw["cancelled"],
            earlier_wall_s=raw.get("earlier_wall_s", 0.0),
        )


class Journal(Protocol):
    """Where an executor records each replica it creates: before the create call and after it."""

    def launching(self, rank: int, meta: dict[str, str]) -> ReplicaHandle:
        """Record that an attempt of ``rank`` is about to be created, found without an id by ``meta``, and
        return its handle (attempt number assigned, no backend id). Raises if it cannot be recorded: then
        nothing may be created."""
        ...

    def launched(self, handle: ReplicaHandle) -> None:
        """Record the created attempt: ``launching``'s handle with its backend id."""
        ...


class BackendError(RuntimeError):
    """A backend's API refused or failed a request, said for the user: the cause and the fix.

    ``exit_code`` 2: the user must fix something (credentials, credits, permissions, a name); 1: the failure
    was transient (rate limits, server errors, the network) and outlasted the retries.
    """

    def __init__(self, message: str, exit_code: Literal[1, 2]) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@runtime_checkable
class ServerlessExecutor(Protocol):
    """A backend that runs replicas. Implementations: local processes, Modal functions, HF Jobs.

    Every method that talks to a backend's API raises ``BackendError`` for what the API refused. Each also
    has ``run_secrets`` (name -> value): secrets the launcher made for the run (the run key), set before
    ``launch`` and delivered with the replicas' other secrets, never part of a plan.
    """

    name: str

    def plan(self, config: RunConfig, run_url: str) -> LaunchPlan:
        """The replicas, resources and cost for ``config``; raises ConfigError for what cannot work."""
        ...

    def preflight(self, plan: LaunchPlan) -> list[str]:
        """Problems in this machine's setup that would make ``launch`` fail (credentials), without network."""
        ...

    def check_access(self, plan: LaunchPlan) -> None:
        """Ask the backend whether these credentials may launch ``plan`` (one cheap authenticated call),
        before anything is written; raises BackendError."""
        ...

    def launch(self, plan: LaunchPlan, journal: Journal) -> list[ReplicaHandle]:
        """Create the plan's replicas, each recorded in ``journal`` before and after it is created."""
        ...

    def status(self, handles: list[ReplicaHandle]) -> list[ReplicaStatus]: ...

    def logs(self, handle: ReplicaHandle, follow: bool = False, tail: int | None = None) -> Iterator[str]:
        """The replica's log, whole lines; with ``tail``, only its last ``tail`` lines."""
        ...

    def cancel(self, handles: list[ReplicaHandle]) -> None:
        """End these attempts (an attempt still being created too, found by its meta); attempts that have
        already ended are left alone without error."""
        ...

    def cancel_run(self, record: LaunchRecord) -> None:
        """End every replica the run's record names, every attempt, and whatever else the backend holds for
        the run (its jobs by label, its Modal apps, its worker processes)."""
        ...
