"""Validate -> plan -> check this machine -> create the run in the store -> launch -> watch -> report.

The launcher and the replicas share nothing but the store: the launcher writes ``run.json`` (and the tiny
model, if the config asks for one), starts the replicas with the run's URL, records how to find them again
(``launch.json``), draws their heartbeats, and finally writes the report from the metrics they left in the
store. Everything that can be checked is checked before the first write: the config and the plan (no
network), this machine's credentials (no network), the data, the rewards and the model (each in a child
process), then the store (one probe object, deleted again). A dry run makes the same checks but the store's,
offline: a Hub model not in this machine's cache is reported as not checked, with why.

Watching, and what Ctrl-C and SIGTERM do then, is ``watch.py``'s, shared with ``sweep``. ``resume`` restarts
every replica of an existing run whose replicas all died: they continue from its latest published state,
with the keys a resume may change changed if asked (``config/resume.py``), a finished run to a new end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import secrets
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rich.console import Console

from composer_serverless.config import ConfigError, RunConfig, apply_override, validate_config
from composer_serverless.config.composer import BUILTIN_REWARDS
from composer_serverless.config.resume import (
    code_refusal_message,
    cosine_note,
    refusal_message,
    sort_changes,
)
from composer_serverless.executors import make_executor, measured, pricing, shipment
from composer_serverless.executors.base import (
    TERMINAL_STATES,
    LaunchPlan,
    LaunchRecord,
    ReplicaHandle,
    ReplicaStatus,
    ServerlessExecutor,
    model_plan,
)
from composer_serverless.executors.fit import plan_devices
from composer_serverless.executors.opening import STORE_HINT, absolute_store, open_created, open_store
from composer_serverless.harvest import plan as harvest_plan
from composer_serverless.launch import watch
from composer_serverless.launch.supervisor import Supervisor, sigterm_cancels
from composer_serverless.launch.watch import Choice, Followed, ReplicaView, cancel_on_interrupt
from composer_serverless.objectives import inputs
from composer_serverless.outputs import export
from composer_serverless.rendezvous import config_changes, layout, runkey
from composer_serverless.rendezvous import shipped as shipped_code
from composer_serverless.rendezvous.latest import NoIntactState, newest_version, roll_back
from composer_serverless.rendezvous.run_keys import checked_run_key, new_run_key
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import read_heartbeats
from composer_serverless.tracking import trackers

# Loading a config and a tokenizer from the Hub and building the model on the meta device: seconds to a minute.
# How long the model check or the reward check (each a child process) may take.
CHILD_CHECK_TIMEOUT_S = 300.0
# The states of a replica that a resume starts again beside live ones.
_RESTARTED = frozenset({"failed", "cancelled", "unscheduled"})
# The states in which an attempt whose id was recorded is known to have ended (not ``unscheduled``: a job past
# its scheduling deadline may still be waiting for hardware).
_KNOWN_ENDED = frozenset({"succeeded", "failed", "cancelled"})

__all__ = ["Prepared", "prepare", "start", "launch", "resume", "follow", "create_run"]


def new_run_id(source: str) -> str:
    stem = "".join(c if c.isalnum() else "-" for c in Path(source).stem.lower()).strip("-")[:30] or "run"
    return f"{stem}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


def create_run(
    config: RunConfig,
    source: str,
    console: Console,
    shipped: shipment.Shipment | None = None,
    ship_code: bool = False,
) -> tuple[ObjectStore, RunConfig]:
    """Create the run in the store: the model (if built here), the shipped data and code (``ship_code``: for
    replicas that fetch it) first, ``run.json`` last and exactly once."""
    root = ObjectStore(config.store)
    root.ensure_root()
    run_id = config.run_id or new_run_id(source)
    run = root.child(run_id)
    if run.exists(layout.RUN_CONFIG):
        raise ConfigError(
            f"run {run.url} already exists\n  fix: choose another run_id, or leave run_id unset"
        )
    key = None
    if config.diloco.authenticate:  # made and saved before the run's first object is written
        key = new_run_key(run.url)
        runkey.record_fingerprint(run, key)
    # Validated again (model_copy would not): whatever reaches run.json is exactly what replicas will accept.
    resolved = validate_config({**config.model_dump(), "run_id": run_id}, source="the resolved config")
    if resolved.model.tiny is not None:
        with console.status("building the tiny model and its tokenizer"):
            _build_tiny_into(run, resolved)
    if shipped is not None:
        with console.status("uploading the run's data and code") as status:

            def progress(sent: int, total: int) -> None:
                status.update(f"uploading the model: {sent / 1e9:.2f} of {total / 1e9:.2f} GB")

            shipment.upload(
                run,
                shipped,
                code=ship_code,
                key=None if key is None else key.for_run(run_id),
                progress=progress,
            )
        # On every backend, shipped through the store or not: what a resume compares its code with.
        shipped_code.record(run, _code_digests(shipped))
    if not run.create(layout.RUN_CONFIG, resolved.resolved_json().encode()):
        raise ConfigError(
            f"run {run.url} was created concurrently by someone else\n  fix: choose another run_id"
        )
    return run, resolved


def _build_tiny_into(run: ObjectStore, config: RunConfig) -> None:
    from composer_serverless.data.corpus import stdlib_corpus, training_text
    from composer_serverless.models.loading import build_tiny

    tiny = config.model.tiny
    assert tiny is not None
    texts: Iterable[str] = ()
    if tiny.tokenizer == "bpe":
        corpus = stdlib_corpus(config.data.heldout_percent)
        texts = training_text(corpus, int(tiny.tokenizer_corpus_mb * 1e6), config.seed)
    with tempfile.TemporaryDirectory() as out:
        build_tiny(tiny, texts, Path(out), seed=config.seed)
        run.upload_dir(Path(out), layout.MODEL)


@dataclass(frozen=True)
class ModelFacts:
    """What the model check found besides problems: the parameters (``total``, ``trainable``), or why the
    model was not checked (``unchecked``: a Hub model offline); both None for the tiny model, built here."""

    parameters: dict[str, int] | None = None
    unchecked: str | None = None


@dataclass
class Prepared:
    """A run decided but not started: resolved config (run id, absolute local store), executor, plan.

    ``problems`` lists what this machine lacks for the launch (credentials, ...), found without network.
    ``model`` is what the model check found; ``auto_alpha`` whether SDPO's weight was decided here ('auto').
    """

    config: RunConfig
    source: str
    run: ObjectStore
    executor: ServerlessExecutor
    plan: LaunchPlan
    problems: list[str]
    shipped: shipment.Shipment
    model: ModelFacts = ModelFacts()
    auto_alpha: bool = False


def prepare(
    config: RunConfig, source: str, offline: bool = False, console: Console | None = None
) -> Prepared:
    """Resolve the run id, check the data, the rewards and the model, build the executor and its plan; raises
    ConfigError for a plan that cannot work. ``offline`` (a dry run): the model check reads the Hub from this
    machine's cache only, and says what it could not check. ``console`` shows a spinner while the model is
    checked (a download from the Hub can take a minute)."""
    if config.code.accept_changes:
        raise ConfigError(
            "code.accept_changes is for `launch --resume RUN`: it lets a resume run code that changed since the "
            "run shipped it, and a new run ships its code as it is\n  fix: drop code.accept_changes"
        )
    store = absolute_store(config.store)
    run_id = config.run_id or new_run_id(source)
    # Validated again (model_copy would not): the plan is built from exactly what run.json will hold.
    raw = {**config.model_dump(), "run_id": run_id, "store": store}
    resolved = validate_config(raw, source="the resolved config")
    train = inputs.check(resolved)  # reads every data file: bad records fail here
    resolved = _with_rewards_checked(resolved, train)
    run = open_store(store, fix=STORE_HINT).child(run_id)
    executor = make_executor(resolved, run)
    plan = _plan(executor, resolved, run)
    # Before the data settings name the run's prefix, where nothing is uploaded yet: the check reads them.
    model = ModelFacts()
    if resolved.model.path is not None:
        with contextlib.nullcontext() if console is None else console.status(_CHECKING_MODEL):
            model = check_model(resolved, offline)
    plan = _with_measured_cost(plan, resolved, model)
    # Data named by a local path reaches cloud replicas through the run's prefix: run.json names it there.
    shipped = shipment.from_plan(plan.resources["shipped"])
    resolved = shipment.with_uploaded_data(resolved, run.url, shipped)
    problems = _preflight(executor, plan, resolved)
    auto_alpha = config.composer is not None and config.composer.alpha == "auto"
    return Prepared(resolved, source, run, executor, plan, problems, shipped, model, auto_alpha)


_CHECKING_MODEL = "checking the model (config, tokenizer, a meta-device instance)"


def _with_measured_cost(plan: LaunchPlan, config: RunConfig, model: ModelFacts) -> LaunchPlan:
    """The plan with an expected cost at a step time the project measured on its GPU for a model of this
    size and this workload (``executors/measured.py``), when there is one and the config gives none."""
    gpu = plan_devices(config, plan).gpu
    if plan.cost.price_per_replica_hour == 0 or gpu is None or model.parameters is None:
        return plan
    found = measured.find(measured.load(), gpu, model.parameters["total"], config)
    if found is None:
        return plan
    syncer = plan.syncer_cost and pricing.with_measured(plan.syncer_cost, config, found)
    return dataclasses.replace(plan, cost=pricing.with_measured(plan.cost, config, found), syncer_cost=syncer)


def _with_rewards_checked(config: RunConfig, train: list[Any]) -> RunConfig:
    """The composer objective's rewards imported and called in a child process (``reward_check``), and SDPO's
    weight decided when it is 'auto': run.json holds the number."""
    composer = config.composer
    if composer is None:
        return config
    feedback = False  # of the user's rewards (the built-ins give it, as sdpo_weight knows)
    user_code = any(r.fn not in BUILTIN_REWARDS for r in composer.rewards) or composer.episodes is not None
    if user_code:  # rewards, tools and environments are imported where they cannot reach here
        found = _child_check("composer_serverless.objectives.reward_check", config, "the reward check")
        if found["problems"]:
            raise ConfigError(
                "the rewards, tools or environment cannot be used as configured:\n"
                + "\n".join(textwrap.indent(p, "  ") for p in found["problems"])
            )
        feedback = found["feedback"]
    if composer.alpha != "auto":
        return config
    raw = config.model_dump()
    raw["composer"]["alpha"] = inputs.sdpo_weight(composer, train, feedback)
    return validate_config(raw, source="the resolved config")


def _preflight(executor: ServerlessExecutor, plan: LaunchPlan, config: RunConfig) -> list[str]:
    """What this machine lacks for the launch: the executor's credentials, the teachers' keys of a live
    harvest (the launcher harvests, so they are needed here, never by the replicas), for a push at the end
    ([output]) the Hub token and a valid repo id, and the clients of the trackers it relays to."""
    problems = executor.preflight(plan)
    if config.live_harvest and config.harvest is not None:
        problem = harvest_plan.key_problem(config.harvest)
        if problem is not None:
            problems.append(problem)
    return problems + export.push_problems(config.output) + trackers.missing(config.tracking)


def _plan(executor: ServerlessExecutor, config: RunConfig, run: ObjectStore) -> LaunchPlan:
    return dataclasses.replace(executor.plan(config, run.url), model=model_plan(config))


def start(prepared: Prepared, console: Console) -> Supervisor:
    """Create the run in the store and start its replicas; nothing is written if a check fails first (the
    backend is asked whether the credentials may launch before the store is touched)."""
    if prepared.problems:
        raise ConfigError("cannot launch:\n" + "\n".join(textwrap.indent(p, "  ") for p in prepared.problems))
    prepared.executor.check_access(prepared.plan)
    ship_code = prepared.plan.resources["shipped"]["how"] == shipment.STORE
    run, _ = create_run(prepared.config, prepared.source, console, prepared.shipped, ship_code)
    _hand_over_key(prepared.executor, run, prepared.config)
    record = LaunchRecord(prepared.plan, (), created_at=time.time())
    return _start_replicas(run, prepared.executor, record, prepared.config, console)


def _hand_over_key(executor: ServerlessExecutor, run: ObjectStore, config: RunConfig) -> None:
    """Give the executor the run key of an authenticated run, to deliver to every replica as a secret (and
    again to every replica it relaunches)."""
    if not config.diloco.authenticate:
        return
    executor.run_secrets[runkey.ENV] = checked_run_key(run).hex()


def check_model(config: RunConfig, offline: bool = False) -> ModelFacts:
    """Run the model check (``models/check.py``) in a child process, so this one never imports torch; with
    ``offline``, the Hub is read from this machine's cache only.

    Raises:
        ConfigError: every problem found, each with its fix; or the check could not run at all.
    """
    checked = json.dumps({k: json.loads(config.resolved_json())[k] for k in _CHECKED})
    found = _model_check(checked, offline)
    if found["problems"]:
        raise ConfigError(
            "the model cannot be trained as configured:\n"
            + "\n".join(textwrap.indent(p, "  ") for p in found["problems"])
        )
    return ModelFacts(found["parameters"], found["unchecked"])


# What the model check reads of a run; a sweep's cells that agree on these are checked once. The harvest table
# goes with them: a live harvest is what lets the replay channel start without a pairs file.
_CHECKED = ("model", "data", "train", "composer", "diloco", "harvest")


@functools.lru_cache(maxsize=8)
def _model_check(checked: str, offline: bool) -> dict[str, Any]:
    raw = json.loads(checked)
    config = validate_config({**raw, "executor": {"type": "local"}}, source="the model check")
    args = ("--offline",) if offline else ()
    return _child_check("composer_serverless.models.check", config, "the model check", args)


def _child_check(module: str, config: RunConfig, what: str, args: Sequence[str] = ()) -> Any:
    """What the check ``python -m module *args`` prints last (JSON), given the resolved ``config`` on stdin:
    run in a child process, so that what it imports (torch, the user's code) never enters the launcher.

    Raises:
        ConfigError: the check did not finish in time, or failed without an answer (its stderr's tail).
    """
    try:
        result = subprocess.run(
            [sys.executable, "-m", module, *args],
            input=config.resolved_json(),
            capture_output=True,
            text=True,
            timeout=CHILD_CHECK_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise ConfigError(f"{what} did not finish in {CHILD_CHECK_TIMEOUT_S:.0f}s") from None
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        tail = "\n".join(result.stderr.strip().splitlines()[-8:])
        raise ConfigError(f"{what} could not run (exit {result.returncode}):\n{tail}")
    return json.loads(lines[-1])


def _start_replicas(
    run: ObjectStore,
    executor: ServerlessExecutor,
    record: LaunchRecord,
    config: RunConfig,
    console: Console,
    restart: list[ReplicaHandle] | None = None,
) -> Supervisor:
    """Write ``launch.json`` (``record``: the plan, and the attempts of earlier launches), then start every
    replica of the plan, or only the ranks of the ended attempts ``restart``, each recorded before it is
    created and again once it has an id (``Supervisor.start``). From here on the launcher's writes ride out
    a store outage as the replicas' do (``diloco.store_outage_s``); the probe before failed at once."""
    run.tolerate_outages(config.diloco.store_outage_s)
    supervisor = Supervisor(run, executor, record)
    supervisor.save()

    def note(line: str) -> None:
        console.print(f"[yellow]{line}[/]", highlight=False)

    if restart is None:
        supervisor.start(record.plan, note)
    elif restart:
        supervisor.restart(restart, note)
    return supervisor


@sigterm_cancels()
def launch(
    config: RunConfig, source: str, console: Console, on_interrupt: Callable[[], Choice] = cancel_on_interrupt
) -> dict[str, Any] | None:
    """Run ``config`` to the end and return its summary, or None if the user detached.

    Raises:
        ConfigError: the config, the plan or this machine's setup cannot work; nothing was launched.
        StoreError: the store cannot be written; nothing was launched.
        RunFailed: a replica failed for good; the others were cancelled.
        RunCancelled: the run was cancelled, here (Ctrl-C, then "cancel"; SIGTERM while it was watched) or
            from elsewhere.
        Terminated: SIGTERM before the run was watched; any replica started was cancelled.
    """
    prepared = prepare(config, source, console=console)
    supervisor = start(prepared, console)
    return follow(supervisor, prepared.config, console, on_interrupt)


@sigterm_cancels()
def resume(
    run_url: str,
    console: Console,
    on_interrupt: Callable[[], Choice] = cancel_on_interrupt,
    overrides: Sequence[str] = (),
) -> dict[str, Any] | None:
    """Continue the run at ``run_url`` and watch it to its end, as ``launch`` does; never a second set of
    replicas beside live ones. ``overrides`` (``dotted.key=value``) change keys a resume may change
    (``config/resume.py``): a finished run goes on to a larger ``diloco.rounds``, say.

    If any replica of the run still runs (the launcher died, or detached), the resume adopts them: it watches
    the live ones again and starts only the ranks whose replica has ended, which rejoin from the store as a
    relaunched replica does; nothing is rolled back, since live replicas depend on the state as it is.
    Adopting rather than refusing keeps the rounds the live replicas are in, and gives the run its supervisor
    (relaunches, progress, the report) back.

    If none runs, every earlier attempt not known to have ended is ended first (cancelled, and seen ended:
    ``_end_open_attempts``), then the run is rolled back to its newest checkpoint (``latest.roll_back``) and
    every replica is started again, continuing from it and their own states saved with it: the rounds after
    the checkpoint are redone. A decoupled run is not rolled back: its syncer and learners (the syncer's rank
    among them) continue from its newest global version (``_resume_point``). Either way the new attempts are added to ``launch.json`` beside the earlier
    ones, so ``cancel`` still reaches every one.

    With ``overrides`` there is no adopting: ``run.json`` is rewritten only while no replica of the run is live
    (a replica never sees two configs), after the roll back and before any replica starts, and the change is
    recorded with the round it starts after (``config_changes``). The old end's report is removed, so the new
    end writes its own; ``final/`` is rewritten by the new last round.

    The user's code (reward files, ``[code] paths``) must be what the run shipped (``code.json``): local
    replicas import it in place and Modal builds it into the image, so an edit would otherwise reach them
    silently, and not HF Jobs replicas, which fetch what was uploaded. Changed code is refused with each file
    named, unless ``overrides`` set ``code.accept_changes=true``: then, as with a changed key, there is no
    adopting, and the change is recorded per file (``code/<file>``, old and new sha256) with the round it
    starts after, the code shipped again where replicas fetch it, and its new digests recorded.

    Raises:
        ConfigError: ``run_url`` holds no run, an override is refused (each with why), the code changed
            without ``code.accept_changes``, the run has finished with nothing to extend, a replica is live
            while overrides or changed code are given, or this machine cannot launch its replicas; nothing
            was written or started.
        BackendError: the backend refused the credentials or could not be reached; nothing started.
        StoreError: the store cannot be written; nothing was launched.
        RunFailed, RunCancelled: as for ``launch``.
    """
    run, created = open_created(run_url)
    config, changed, accept_code = _overridden(created, overrides)
    executor = make_executor(config, run)
    plan = _plan(executor, config, run)
    problems = _preflight(executor, plan, config)
    if problems:
        raise ConfigError("cannot resume:\n" + "\n".join(textwrap.indent(p, "  ") for p in problems))
    if run.exists(layout.SUMMARY) and config.diloco.rounds == created.diloco.rounds:
        raise ConfigError(
            f"run {config.run_id} at {run.url} has finished its {config.diloco.rounds} rounds (its report: "
            f"{run.url_of(layout.SUMMARY)}); there is nothing to resume\n  fix: composer-serverless status RUN "
            f"shows its outcome; --set diloco.rounds=<more than {config.diloco.rounds}> trains it further"
        )
    code = _code_now(run, plan, accept_code)
    executor.check_access(plan)
    if config.diloco.authenticate:  # before anything is changed: a resume without the key cannot work
        _hand_over_key(executor, run, config)
    earlier = _launch_record(run)
    if earlier is not None:
        statuses = executor.status(earlier.current())
        live = [s.rank for s in statuses if s.state not in TERMINAL_STATES]
        if (changed or code.changed) and live:
            raise ConfigError(
                f"run {config.run_id} still has live replicas ({', '.join(map(str, live))}): --set changes "
                "run.json or the code, which a live replica has read, and no replica may ever train with two "
                f"configs or two versions of the code\n  fix: wait until `composer-serverless status {run.url}` "
                "shows none running (or cancel the run), then resume with --set; or resume without --set to "
                "watch them"
            )
        if not (changed or code.changed) and (
            live or (statuses and all(s.state == "succeeded" for s in statuses))
        ):
            return _adopt(run, executor, config, earlier, statuses, console, on_interrupt)
        _end_open_attempts(run, executor, earlier, console)
    run.ensure_root()
    earlier_wall_s = _wall_so_far(run)
    resumed = _resume_point(run, config, console)
    if changed or code.changed:
        _reconfigure(run, created, config, changed, resumed, console, code)
    if code.digests is None:  # a run from before runs recorded their code: from here on, resumes compare
        shipped_code.record(run, code.now)
    handles = earlier.handles if earlier is not None else ()
    record = LaunchRecord(plan, handles, created_at=time.time(), earlier_wall_s=earlier_wall_s)
    return follow(_start_replicas(run, executor, record, config, console), config, console, on_interrupt)


def _resume_point(run: ObjectStore, config: RunConfig, console: Console) -> int:
    """Where the resumed replicas continue, said on the console: lock-step's run is rolled back to its
    newest intact checkpoint (``latest.roll_back``); a decoupled run continues from its newest global version
    as it is, with nothing rolled back: every version is committed whole, its syncer continues after it, and
    its learners from the newest intact version and their own states (docs/decoupled.md)."""
    if config.diloco.mode == "decoupled":
        newest = max(newest_version(run), 0)
        console.print(
            f"resuming run [bold]{config.run_id}[/] from its global version {newest}: the syncer merges on from "
            "it, each learner starts from it and its own state",
            highlight=False,
        )
        return newest
    try:
        back = roll_back(run, config.ranks_per_replica)
    except NoIntactState as e:
        raise ConfigError(
            f"cannot resume: {e}\n  fix: launch a new run (the model can start from this run's final/ or an "
            "exported checkpoint with model.path)"
        ) from e
    for skipped in back.skipped:
        console.print(f"[yellow]passing over[/] {skipped}", highlight=False)
    console.print(
        f"resuming run [bold]{config.run_id}[/] from its "
        + (
            "checkpoint"
            if back.checkpoint
            else "newest intact state, not a checkpoint (the rounds after it may differ from an uninterrupted run's)"
        )
        + f" of round {back.round}",
        highlight=False,
    )
    return back.round


def _overridden(
    created: RunConfig, overrides: Sequence[str]
) -> tuple[RunConfig, dict[str, tuple[Any, Any]], bool]:
    """The run's config with a resume's ``overrides`` applied, the keys they change ((old, new) by key), and
    whether they accept changed code (``code.accept_changes``: for this resume only, so neither the config
    returned, which becomes run.json, nor the changes hold it).

    Raises:
        ConfigError: an override is malformed or invalid, or changes a key a resume may not change (each
            named with why: ``config/resume.py``).
    """
    if not overrides:
        return created, {}, False
    raw = json.loads(created.resolved_json())
    for override in overrides:
        apply_override(raw, override)
    source = f"run {created.run_id}'s run.json with the --set overrides"
    accept = validate_config(raw, source=source).code.accept_changes
    raw["code"]["accept_changes"] = False  # an instruction to this resume, not a key of the run's config
    config = validate_config(raw, source=source)
    changes = sort_changes(created, config)
    if changes.refused:
        raise ConfigError(refusal_message(changes.refused))
    return config, changes.changed, accept


@dataclass(frozen=True)
class CodeNow:
    """The user's code a resume is about to run, against what the run shipped before.

    Attributes:
        shipped: the code as the backend ships it now (no data: a resume uploads none again).
        fetched: the backend's replicas fetch the code from the run's store prefix (``shipment.STORE``).
        now: each of its files by its sha256 now.
        digests: what the run recorded (``shipped.recorded``); None for a run that recorded none.
        changed: each file whose sha256 differs, as (recorded, now); empty when none does or none was recorded.
    """

    shipped: shipment.Shipment
    fetched: bool
    now: dict[str, str]
    digests: dict[str, str] | None
    changed: dict[str, tuple[str | None, str | None]]


def _code_now(run: ObjectStore, plan: LaunchPlan, accept: bool) -> CodeNow:
    """The code a resume would run, compared with the digests the run recorded (reads, writes nothing).

    Raises:
        ConfigError: it changed and ``accept`` is not set: each file named, and the two ways on.
    """
    described = plan.resources["shipped"]
    shipped = dataclasses.replace(shipment.from_plan(described), data=())
    now = _code_digests(shipped)
    before = shipped_code.recorded(run)
    changed = {} if before is None else shipped_code.compare(before, now)
    if changed and not accept:
        raise ConfigError(code_refusal_message(changed))
    return CodeNow(shipped, described["how"] == shipment.STORE, now, before, changed)


def _code_digests(shipped: shipment.Shipment) -> dict[str, str]:
    return {} if shipped.root is None else shipped_code.digests(shipped.root, shipped.code)


def _reconfigure(
    run: ObjectStore,
    created: RunConfig,
    config: RunConfig,
    changed: dict[str, tuple[Any, Any]],
    resumed_round: int,
    console: Console,
    code: CodeNow,
) -> None:
    """Make ``config`` and ``code`` the run's: every replica is ended and none is started yet. The old end's
    report goes first: a launcher that dies half-way leaves a run a plain resume (or this one, again)
    continues, never a finished-looking run with the new config. Changed code is recorded as
    ``code/<file>`` from its old sha256 to its new one, then shipped again to replicas that fetch it (where
    the run ships its code through the store), and its digests recorded last."""
    for report in (layout.SUMMARY, layout.LOSS_PLOT, layout.REWARD_PLOT):
        run.delete(report)
    code_changes = {f"{layout.CODE}/{rel}": digests for rel, digests in code.changed.items()}
    config_changes.record(run, resumed_round, {**changed, **code_changes})
    if changed:
        run.put(layout.RUN_CONFIG, config.resolved_json().encode())
        console.print(
            f"changed in run.json from round {resumed_round + 1} on: "
            + ", ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in changed.items()),
            highlight=False,
        )
    if code.changed:
        if code.fetched:
            key = checked_run_key(run).for_run(config.run_id or "") if config.diloco.authenticate else None
            shipment.upload(run, code.shipped, code=True, key=key)
        shipped_code.record(run, code.now)
        console.print(
            f"[yellow]the code changed since the run shipped it; from round {resumed_round + 1} on, the replicas "
            f"run it as it is now (code.accept_changes):[/] {', '.join(code.changed)}",
            highlight=False,
        )
    note = cosine_note(created, config, resumed_round)
    if note is not None:
        console.print(f"[yellow]{note}[/]", highlight=False)


def _adopt(
    run: ObjectStore,
    executor: ServerlessExecutor,
    config: RunConfig,
    earlier: LaunchRecord,
    statuses: list[ReplicaStatus],
    console: Console,
    on_interrupt: Callable[[], Choice],
) -> dict[str, Any] | None:
    """Watch the run's live replicas again and start the ranks whose replica has ended (see ``resume``)."""
    if earlier.cancelled:
        raise ConfigError(
            f"run {config.run_id} was cancelled and some of its replicas are still ending\n"
            f"  fix: wait until `composer-serverless status {run.url}` shows none running, then resume"
        )
    live = [s.rank for s in statuses if s.state not in TERMINAL_STATES]
    ended = [h for h, s in zip(earlier.current(), statuses, strict=True) if s.state in _RESTARTED]
    if live:
        console.print(
            f"run [bold]{config.run_id}[/] still has live replicas ({', '.join(map(str, live))}): watching them "
            "again instead of starting a second set"
            + (f"; starting again the ended ones ({', '.join(str(h.rank) for h in ended)})" if ended else ""),
            highlight=False,
        )
    # The launches so far count up to now; this one's clock starts here.
    now = time.time()
    wall = earlier.earlier_wall_s + max(0.0, now - earlier.created_at)
    record = dataclasses.replace(earlier, created_at=now, earlier_wall_s=wall)
    supervisor = _start_replicas(run, executor, record, config, console, restart=ended)
    return follow(supervisor, config, console, on_interrupt)


def _end_open_attempts(
    run: ObjectStore, executor: ServerlessExecutor, earlier: LaunchRecord, console: Console
) -> None:
    """Cancel every earlier attempt of the run that is not known to have ended, and wait until each is seen
    ended, before the roll back and the new attempts: an attempt can read as ended and still be live (a job
    past its scheduling deadline, still SCHEDULING; an attempt whose id was never recorded reads ``failed``
    when no listing shows it, and on Modal its call may still run in its app).

    Raises:
        RunFailed: one still runs after the cancel: starting the replicas again would run it twice.
    """
    handles = list(earlier.handles)
    seen = zip(handles, executor.status(handles), strict=True)
    open_ = [(h, s) for h, s in seen if not (h.created and s.state in _KNOWN_ENDED)]
    if not open_:
        return
    console.print(
        "ending the earlier attempts that may still be live before starting new ones: "
        + ", ".join(f"replica {h.rank} attempt {h.attempt} ({s.state})" for h, s in open_),
        highlight=False,
    )
    Supervisor(run, executor, earlier).end([h for h, _ in open_])


def _launch_record(run: ObjectStore) -> LaunchRecord | None:
    """The run's ``launch.json``, or None if it was never launched (or the record is unreadable)."""
    try:
        return LaunchRecord.from_json(run.get(layout.LAUNCH_RECORD))
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def _wall_so_far(run: ObjectStore) -> float:
    """The wall time the run's launches have spent so far: each from its launch to the last heartbeat any
    replica wrote under it (not the time the run then lay dead before this resume)."""
    record = _launch_record(run)
    if record is None:
        return 0.0
    last = max((beat.get("time", 0.0) for beat in read_heartbeats(run).values()), default=record.created_at)
    return record.earlier_wall_s + max(0.0, last - record.created_at)


def follow(
    supervisor: Supervisor,
    config: RunConfig,
    console: Console,
    on_interrupt: Callable[[], Choice] = cancel_on_interrupt,
) -> dict[str, Any] | None:
    """Watch a started run to its end, then write and print its report; None if the user detached."""
    plan = supervisor.record.plan
    console.print(
        f"run [bold]{plan.run_id}[/] at {supervisor.run.url}: {config.diloco.replicas} {plan.executor} replicas"
        + (f" of {plan.ranks_per_replica} ranks" if plan.ranks_per_replica > 1 else "")
        + (f" and the syncer ({plan.syncer_hardware()})" if plan.syncer_cost else "")
        + "\n"
        f"  estimated cost: {plan.cost.summary()}"
        + (f"\n  the syncer's: {plan.syncer_cost.summary()}" if plan.syncer_cost else ""),
        highlight=False,
    )
    run = Followed(supervisor, config)
    if not watch.follow([run], ReplicaView(run, console), on_interrupt, fail_fast=True):
        return None
    watch.write_reports([run])
    watch.print_report(run, console)
    if config.output.push_to_hub is not None:
        export.publish(supervisor.run.url, config.output, console)
    return run.summary
