"""Goodput of N = 4 learners under stragglers and preemptions: lock-step DiLoCo beside the decoupled mode.

    python benchmarks/goodput.py --out docs/results/goodput                  # every scenario, both modes
    python benchmarks/goodput.py --out bench-out/goodput-a --scenarios a --modes lock-step

Each run is the demo's model and data (``deploy/configs/local-demo.toml``) on 4 local learner processes
launched through ``launcher.launch`` (a ``file://`` store under ``--out``, the supervisor restarting what
dies), short: ``--rounds`` outer rounds of ``--sync-every`` inner steps of ``--batch-size`` sequences,
held-out loss after every round. Four scenarios (the issue's), injected by this benchmark from outside the
processes, never by a product setting:

- ``a``: no faults, equal speeds.
- ``b``: learner 3 at half speed: its process is stopped (SIGSTOP) and continued (SIGCONT) in turn, half of
  every ``THROTTLE_PERIOD_S``, as ``cpulimit`` does: a machine half as fast, whose clock still runs.
- ``c``: preemptions: each learner is SIGKILLed at random times (exponential gaps of mean ``--mtbi-s``,
  drawn with the seed), and each restarted process is held stopped for ``--cold-start-s`` before it may run,
  as a cloud replica waits for its container (on top of the restart's own model load).
- ``d``: b and c together.

Reported per run, from the learners' own metrics rows (``metrics/{rank}/{k}.json``) and their processes'
lifetimes (sampled every ``POLL_S``):

- ``goodput``: the share of the learners' alive time (every process's life, start to death or exit, a cold
  start's hold included: a cloud bills it) spent on inner steps whose work reached a merged global: the
  steps' own time (``time_s.step`` minus the part blocked in a sync). Lock-step: in the rows of the rounds
  each learner was a participant of. Decoupled: of the contributions the syncer's version records list as
  merged (``account_decoupled``; a merged contribution no row times is timed at its learner's mean step).
- ``alive_breakdown_s`` / ``alive_shares``: where the rest of the alive time went (``alive_breakdown``: cold
  starts, start-up, unmerged steps, the round in flight at a kill, and the other overheads), so a goodput can
  be read against what no schedule recovers (a cold start, a process's start-up) and what one does.
- ``wall_s_to_tokens``: seconds from the launch until the merged globals hold ``TARGET_SHARE`` of the tokens
  lock-step plans (rounds x H x N x tokens per step): every scenario can reach it with some learners lost.
- ``evals``: every global's held-out loss, with the merged tokens it holds and when it was complete:
  lock-step's rounds as its replicas scored them; decoupled's versions (its learners score only the last)
  scored after the run from the store, which keeps every version, by the product's evaluation
  (``score_versions``: the objective's, on the same held-out sequences, in the run's compute precision).
  ``eval_loss_at_tokens``: the loss of the first global holding the token target.
- per scenario, ``at_equal_tokens``: lock-step's held-out loss at its last round against decoupled's first
  version holding at least as many merged tokens (and the relative gap), and the seconds decoupled took to
  reach lock-step's final loss (its first version scoring at most that) against the seconds lock-step took
  (its last round complete), with their ratio (the issue's bar under d: at most 0.7).
- ``staleness``: how many versions were committed between a merged contribution's base and the version it
  entered (lock-step: always 0, every round starts from the last global).

The decoupled side launches ``diloco.mode = "decoupled"`` with a quorum of ``MIN_QUORUM`` of the 4 learners,
the adaptive grace window of ``grace_gamma``'s default bounded by ``GRACE_S`` (the product's default: no
bound; runs recorded before were bounded at 1 s, and those before the adaptive window waited 1 s) and ``max_lag = MAX_LAG`` (learners never wait for the syncer;
``--max-lag 0`` makes each wait for the merge of its own last contribution, no staleness from the learners'
side), and the other
settings of ``diloco.decoupled`` at their defaults but those ``--set KEY=VALUE`` changes (repeatable, as the
CLI's ``--set``, checked by the config's own validation before anything runs; e.g. ``--set
diloco.decoupled.outer=delayed_nesterov``), written into results.json with the rest of its settings.
Configurations measured in runs of their own (``--modes decoupled``) are compared with one lock-step run per
seed by ``benchmarks/goodput_table.py``.

Writes ``results.json`` and ``goodput.png`` (goodput per scenario and mode; held-out loss against wall time,
and against merged tokens).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch
from rich.console import Console

from composer_serverless.config import ConfigError, RunConfig, apply_override, load_config, validate_config
from composer_serverless.config.decoupled import DecoupledConfig
from composer_serverless.executors.base import LaunchRecord
from composer_serverless.launch.launcher import launch
from composer_serverless.objectives.objective import evaluate, make_objective
from composer_serverless.rendezvous import decoupled as store_versions
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.codec import read_header
from composer_serverless.rendezvous.decoupled import Contribution, Version
from composer_serverless.rendezvous.latest import newest_version
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import read_metrics
from composer_serverless.replicas import precision
from composer_serverless.replicas.weights import load_run_model, swapped_in

LEARNERS = 4
SLOW_RANK = 3
THROTTLE_PERIOD_S = 0.2
MTBI_S = 30.0
COLD_START_S = 8.0
TARGET_SHARE = 0.75
POLL_S = 0.05
MAX_RESTARTS = 10  # per learner: the executor's limit
MODES = ("lock-step", "decoupled")
# The decoupled side: a syncer that merges once 2 of the 4 learners' contributions are in, plus a grace for
# more (the adaptive window, bounded by GRACE_S: the product's default, no bound but the window's own; the
# runs of sections 21 to 26 of docs/RESULTS.md bounded it at 1 s), and learners that never wait for it (a
# contribution may be 1 unmerged when the next round starts). It may commit up to LEARNERS / MIN_QUORUM
# times as many versions as lock-step has rounds, so the work it may merge is at least lock-step's; both
# stop as soon as their last global is committed.
MIN_QUORUM = 2
GRACE_S = DecoupledConfig().grace_s
MAX_LAG = 1


@dataclass(frozen=True)
class Scenario:
    """What is injected into a run: one learner at half speed, random preemptions."""

    name: str
    slow: bool
    preempt: bool


SCENARIOS = {
    "a": Scenario("a: no faults, equal speeds", slow=False, preempt=False),
    "b": Scenario("b: one learner at half speed", slow=True, preempt=False),
    "c": Scenario("c: preemptions", slow=False, preempt=True),
    "d": Scenario("d: half speed and preemptions", slow=True, preempt=True),
}


# --- the schedule and the accounting (pure; tested with hand-computed numbers) ------------------------------


def kill_times(seed: int, learners: int, mtbi_s: float, horizon_s: float) -> list[tuple[float, int]]:
    """Each learner's preemptions as a Poisson process of mean gap ``mtbi_s`` up to ``horizon_s``, drawn with
    ``seed``: (seconds after the launch, rank), in time order."""
    rng = random.Random(seed)
    kills = []
    for rank in range(learners):
        t = rng.expovariate(1 / mtbi_s)
        while t < horizon_s:
            kills.append((t, rank))
            t += rng.expovariate(1 / mtbi_s)
    return sorted(kills)


@dataclass
class Accounting:
    """A run's merged work, from the learners' metrics rows."""

    useful_s: float = 0.0
    executed_steps: int = 0
    merged_steps: int = 0
    # (the time the round's global was complete, the tokens it merged), per merged round in order
    merges: list[tuple[float, float]] = field(default_factory=list)
    eval_time: dict[int, float] = field(default_factory=dict)
    # the merged tokens a global holds, per global (round or version) in order
    tokens_at: dict[int, float] = field(default_factory=dict)
    staleness: Counter[int] = field(default_factory=Counter)
    # merged contributions whose steps' own time no row records (the learner died before it wrote one, or
    # sent another before its next row): timed at that learner's mean recorded step time
    estimated: int = 0


def _inner_seconds(row: dict[str, Any]) -> float:
    """A round's inner steps' own time: each step's time less the part it was held in a sync. A decoupled
    learner's round whose first steps an adoption discarded (``discarded_steps``, ``adopt = "overwrite"``)
    counts only the steps its contribution carries."""
    steps = row.get("step_rows", [])[row.get("discarded_steps", 0) :]
    return sum(s["time_s"]["step"] - s["time_s"].get("sync", 0.0) for s in steps)


def _tokens(row: dict[str, Any]) -> float:
    return sum(s.get("tokens") or 0.0 for s in row.get("step_rows", []))


def account_lock_step(metrics: dict[int, list[dict[str, Any]]]) -> Accounting:
    """Lock-step rounds: round k's participants are in every row of round k that lists them; a learner's
    steps of round k reached a global iff it is one of them. The global of round k is complete when the last
    participant's row of k is written."""
    participants: dict[int, set[int]] = {}
    for rows in metrics.values():
        for row in rows:
            if row["round"] > 0 and "participants" in row:
                participants[row["round"]] = set(row["participants"])
    acc = Accounting()
    merged: dict[int, list[dict[str, Any]]] = {}
    for rank, rows in metrics.items():
        for row in rows:
            acc.executed_steps += row.get("steps", 0)
            if rank in participants.get(row["round"], ()):
                merged.setdefault(row["round"], []).append(row)
    for k in sorted(merged):
        rows = merged[k]
        acc.useful_s += sum(_inner_seconds(r) for r in rows)
        acc.merged_steps += sum(r.get("steps", 0) for r in rows)
        acc.merges.append((max(r["time"] for r in rows), sum(_tokens(r) for r in rows)))
        acc.eval_time[k] = max(r["time"] for r in rows)
        acc.tokens_at[k] = sum(tokens for _, tokens in acc.merges)
        acc.staleness[0] += len(rows)
    return acc


def account_decoupled(
    metrics: dict[int, list[dict[str, Any]]],
    versions: list[Version],
    contributions: dict[tuple[int, int], Contribution],
    committed: dict[int, float],
) -> Accounting:
    """Decoupled versions: version v's record lists the (learner, seq) contributions merged into it; each
    contribution's header its steps, tokens and base version (``contributions``: every one published);
    ``committed`` the time each version's record was created.

    A merged contribution's useful time is its inner steps' own time, from the learner's row that names it
    (``contribution``); a learner writes a row per version it adopts, with its last contribution's steps, so
    a contribution sent before another without a row between them, or just before the learner died, is
    timed at that learner's mean recorded step time (counted in ``estimated``). Staleness is how many
    versions were committed between a contribution's base and the version it entered (v - 1 - base): 0 is
    lock-step's case, a round started from the last global."""
    timed: dict[tuple[int, int], float] = {}
    step_s: dict[int, tuple[float, int]] = {}
    for rank, rows in metrics.items():
        for row in rows:
            if "contribution" in row and row.get("step_rows"):
                timed[(rank, row["contribution"])] = _inner_seconds(row)
        seconds = sum(timed[ids] for ids in timed if ids[0] == rank)
        steps = sum(contributions[ids].steps for ids in timed if ids[0] == rank and ids in contributions)
        step_s[rank] = (seconds, steps)
    # executed: the steps contributions carry, and those an overwriting adoption discarded (rows say how many)
    discarded = sum(row.get("discarded_steps", 0) for rows in metrics.values() for row in rows)
    acc = Accounting(executed_steps=sum(c.steps for c in contributions.values()) + discarded)
    tokens_total = 0.0
    for record in sorted(versions, key=lambda r: r.version):
        if not record.merged:
            continue
        tokens = 0.0
        for learner, seq in record.merged:
            c = contributions[(learner, seq)]
            if (learner, seq) in timed:
                acc.useful_s += timed[(learner, seq)]
            else:
                seconds, steps = step_s.get(learner, (0.0, 0))
                acc.useful_s += c.steps * seconds / steps if steps else 0.0
                acc.estimated += 1
            acc.merged_steps += c.steps
            tokens += c.tokens
            acc.staleness[record.version - 1 - c.base] += 1
        tokens_total += tokens
        acc.merges.append((committed[record.version], tokens))
        acc.eval_time[record.version] = committed[record.version]
        acc.tokens_at[record.version] = tokens_total
    return acc


def read_decoupled(
    run: ObjectStore, learners: int
) -> tuple[list[Version], dict[tuple[int, int], Contribution], dict[int, float]]:
    """The syncer's version records, every published contribution's header (its safetensors metadata: JSON,
    no tensor decoded) and each version record's creation time, from the run's store."""
    newest = newest_version(run)
    records = [store_versions.read_version(run, v) for v in range(newest + 1)]
    committed = {v: run.modified(layout.version(v)) for v in range(newest + 1)}
    contributions: dict[tuple[int, int], Contribution] = {}
    for learner in range(learners):
        for name in run.list(layout.contributions(learner)):
            if name.isdigit():
                meta = read_header(run.get(layout.contribution(learner, int(name))))[0]["__metadata__"]
                fields = {f: int(meta[f]) for f in ("base", "tokens", "steps")}
                contributions[(learner, int(name))] = Contribution(learner, int(name), **fields)
    return records, contributions, committed


def loss_at_tokens(
    tokens_at: dict[int, float], losses: dict[int, float], tokens: float
) -> tuple[float, float] | None:
    """The held-out loss of the first evaluated global holding at least ``tokens`` merged tokens, and the
    tokens it holds; None if no evaluated global holds that many."""
    for k in sorted(losses):
        if k in tokens_at and tokens_at[k] >= tokens:
            return losses[k], tokens_at[k]
    return None


def at_equal_tokens(lock_step: list[list[float]], decoupled: list[list[float]]) -> dict[str, Any]:
    """Both modes' globals side by side, each as ``[global, merged tokens, seconds since launch, held-out
    loss]`` in global order: lock-step's last round against decoupled's first version holding at least its
    tokens (None if none does), the relative gap of their losses; and the seconds decoupled took to reach
    lock-step's final loss (its first version scoring at most that; None if none does) against the seconds
    lock-step took (its last round complete), and their ratio. Also both final globals (``finals``): where
    each run's learning-rate schedule ended, which is the comparison at equal tokens when both runs have
    the same ``rounds`` (decoupled's at most as many tokens then: conservative for it)."""
    last, tokens, seconds, loss = lock_step[-1]
    final = decoupled[-1] if decoupled else None
    out: dict[str, Any] = {
        "tokens": tokens,
        "lock-step": {"round": int(last), "tokens": tokens, "s": seconds, "loss": loss},
        "decoupled": None,
        "relative_gap": None,
        "to_lock_step_final_loss": None,
        "finals": None
        if final is None
        else {
            "lock-step": {"round": int(last), "tokens": tokens, "loss": loss},
            "decoupled": {"version": int(final[0]), "tokens": final[1], "loss": final[3]},
            "relative_gap": final[3] / loss - 1,
        },
    }
    equal = next((g for g in decoupled if g[1] >= tokens), None)
    if equal is not None:
        out["decoupled"] = {"version": int(equal[0]), "tokens": equal[1], "s": equal[2], "loss": equal[3]}
        out["relative_gap"] = equal[3] / loss - 1
    reached = next((g for g in decoupled if g[3] <= loss), None)
    if reached is not None:
        out["to_lock_step_final_loss"] = {
            "version": int(reached[0]),
            "tokens": reached[1],
            "s": reached[2],
            "loss": reached[3],
            "lock_step_s": seconds,
            "ratio": reached[2] / seconds,
        }
    return out


def time_to_tokens(
    merges: list[tuple[float, float]], target: float, start: float
) -> tuple[float, int] | None:
    """Seconds after ``start`` at which the merged tokens first reach ``target``, and how many merges that
    took; None if they never do."""
    total = 0.0
    for i, (when, tokens) in enumerate(merges, start=1):
        total += tokens
        if total >= target:
            return when - start, i
    return None


def lifetimes_s(lives: dict[int, tuple[int, float, float]]) -> dict[int, float]:
    """Alive seconds per rank from each process's (rank, started, last seen alive)."""
    alive: dict[int, float] = {}
    for rank, started, ended in lives.values():
        alive[rank] = alive.get(rank, 0.0) + max(0.0, ended - started)
    return alive


def alive_breakdown(
    lives: dict[int, tuple[int, float, float]],
    cold_s: dict[int, float],
    killed: set[int],
    metrics: dict[int, list[dict[str, Any]]],
    useful_s: float,
) -> dict[str, float]:
    """Where the learners' alive seconds went, summed over every process of every learner (``lives``: pid ->
    (rank, started, last seen alive); ``cold_s``: pid -> the cold-start hold it was given; ``killed``: the
    pids preempted; ``metrics``: the learners' rows, each with its ``time`` and its ``round_s``; a decoupled
    learner's row is timed when it reports it, at its next adoption, so its round's start, ``time - round_s``,
    is a little late and the start-up a little long):

    - ``cold_start``: held stopped before it could run (a cloud's container start);
    - ``start_up``: from then to the start of its first round (imports, model load, checks, learner 0's
      initial evaluation, catching up with the run), or its whole life if it never started one;
    - ``useful``: inner steps whose work reached a merged global (``useful_s``, the accounting's);
    - ``unmerged``: inner steps recorded in rows whose work did not (dropped, discarded, never merged);
    - ``in_flight_at_kill``: a preempted process's time from its last row to its death, the round it had
      not sent;
    - ``other``: the rest: publishing and adopting globals, its own state's checkpoints, waiting (lock-step's
      barrier, ``max_lag``), evaluations, and the unfinished round when the run ends.
    """
    out = dict.fromkeys(("cold_start", "start_up", "useful", "unmerged", "in_flight_at_kill", "other"), 0.0)
    executed = sum(_inner_seconds(row) for rows in metrics.values() for row in rows)
    alive = sum(lifetimes_s(lives).values())
    for pid, (rank, started, ended) in lives.items():
        ready = started + cold_s.get(pid, 0.0)
        out["cold_start"] += min(cold_s.get(pid, 0.0), max(0.0, ended - started))
        rows = [r for r in metrics.get(rank, []) if "round_s" in r and ready <= r["time"] <= ended + POLL_S]
        if not rows:
            out["start_up"] += max(0.0, ended - ready)
            continue
        out["start_up"] += max(0.0, min(r["time"] - r["round_s"] for r in rows) - ready)
        if pid in killed:
            out["in_flight_at_kill"] += max(0.0, ended - max(r["time"] for r in rows))
    out["useful"] = useful_s
    out["unmerged"] = max(0.0, executed - useful_s)
    out["other"] = alive - sum(out.values())
    return {name: round(seconds, 2) for name, seconds in out.items()}


def scorer(
    run: ObjectStore, config: RunConfig, cache: Path
) -> tuple[Callable[[dict[str, torch.Tensor]], float], set[str]]:
    """A function scoring named parameters as the run's global is scored (the objective's evaluation over the
    whole held-out set, ``config.eval.sequences``, in the run's compute precision; lock-step's participants
    each score a share of it), on this process's CPU, and the names of the model's parameters. ``cache``
    receives the run's model when the store is remote."""
    torch.manual_seed(config.seed)
    loaded = load_run_model(run, config, cache)
    model = loaded.model.train()
    objective = make_objective(config, loaded.tokenizer, 0, model=model)  # it keeps the held-out set it drew
    device = next(model.parameters()).device

    def score(params: dict[str, torch.Tensor]) -> float:
        with swapped_in(model, params), precision.compute(config.model, device):
            return evaluate(objective, model)["eval/loss"]

    return score, {name for name, _ in model.named_parameters()}


def score_versions(run: ObjectStore, config: RunConfig, records: list[Version]) -> dict[int, float]:
    """The held-out loss of every version after 0 (``scorer``), from the run's store."""
    with tempfile.TemporaryDirectory(prefix="goodput-") as cache:
        score, _ = scorer(run, config, Path(cache))
        return {
            record.version: score(store_versions.load_params(run, record, None))
            for record in records
            if record.version > 0
        }


# --- the injector ---------------------------------------------------------------------------------------


class Injector(threading.Thread):
    """Watches the run's learner processes (the launch record's pids), records their lifetimes, and injects
    the scenario: the throttle of the slow learner, the preemptions, the cold-start hold of restarts."""

    def __init__(
        self,
        run: ObjectStore,
        scenario: Scenario,
        kills: list[tuple[float, int]],
        start: float,
        cold_start_s: float = COLD_START_S,
    ) -> None:
        super().__init__(name="injector", daemon=True)
        self.run_store = run
        self.scenario = scenario
        self.cold_start_s = cold_start_s
        self.pending = list(kills)
        self.start_time = start
        self.stop = threading.Event()
        self.lives: dict[int, tuple[int, float, float]] = {}  # pid -> (rank, started, last seen alive)
        self.held: dict[int, float] = {}  # pid -> when its cold start ends
        self.cold: dict[int, float] = {}  # pid -> the cold start it was held for
        self.kills: list[dict[str, Any]] = []
        self.missed = 0
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._current: dict[int, int] = {}  # rank -> pid of its latest attempt

    def run(self) -> None:
        throttle = threading.Thread(target=self._throttle, name="throttle", daemon=True)
        if self.scenario.slow:
            throttle.start()
        try:
            while not self.stop.is_set():
                self._tick(time.time())
                time.sleep(POLL_S)
        except BaseException as e:  # reported after the launch returns
            self.error = e
        finally:
            self.stop.set()
            if throttle.is_alive():
                throttle.join()
            with self._lock:  # never leave a learner stopped
                for pid in list(self.held) + list(self._current.values()):
                    _signal(pid, signal.SIGCONT)

    def _tick(self, now: float) -> None:
        try:
            record = LaunchRecord.from_json(self.run_store.get(layout.LAUNCH_RECORD))
        except FileNotFoundError:
            return
        with self._lock:
            for handle in record.current():
                if not handle.created:
                    continue
                pid = int(handle.backend_id)
                if pid not in self.lives and _alive(pid):
                    started = psutil.Process(pid).create_time()
                    restart = handle.rank in self._current
                    self.lives[pid] = (handle.rank, started, now)
                    if restart and self.scenario.preempt:
                        _signal(pid, signal.SIGSTOP)
                        self.held[pid] = now + self.cold_start_s
                        self.cold[pid] = self.cold_start_s + now - started  # since its start
                self._current[handle.rank] = pid
            for pid, (rank, started, _) in list(self.lives.items()):
                if _alive(pid):
                    self.lives[pid] = (rank, started, now)
            for pid, until in list(self.held.items()):
                if now >= until:
                    del self.held[pid]
                    _signal(pid, signal.SIGCONT)
            while self.pending and now - self.start_time >= self.pending[0][0]:
                _, rank = self.pending.pop(0)
                pid = self._current.get(rank)
                if pid is None or pid in self.held or not _alive(pid):
                    self.missed += 1  # not running yet, or still cold-starting: nothing to preempt
                    continue
                os.kill(pid, signal.SIGKILL)
                rank_, started, _ = self.lives[pid]
                self.lives[pid] = (rank_, started, now)
                self.kills.append({"rank": rank, "pid": pid, "at_s": round(now - self.start_time, 2)})

    def _throttle(self) -> None:
        """Half of every period stopped: the slow learner's latest process, unless it is held."""
        while not self.stop.is_set():
            for sig in (signal.SIGSTOP, signal.SIGCONT):
                with self._lock:
                    pid = self._current.get(SLOW_RANK)
                    if pid is not None and pid not in self.held:
                        _signal(pid, sig)
                time.sleep(THROTTLE_PERIOD_S / 2)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by the supervisor, does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


# --- the runs -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    """One run's size: outer rounds of ``sync_every`` inner steps of ``batch_size`` sequences."""

    rounds: int
    sync_every: int
    batch_size: int
    eval_sequences: int


def run_config(
    base: RunConfig,
    sizes: Sizes,
    mode: str,
    seed: int,
    run_id: str,
    out: Path,
    max_lag: int = MAX_LAG,
    overrides: tuple[str, ...] = (),
) -> RunConfig:
    """The demo's config at ``sizes`` in ``mode``. Lock-step waits for stragglers as the chaos soak does (a
    quorum of 2, a grace of 2 to 10 s); decoupled merges at a quorum of ``MIN_QUORUM``, its learners
    ``max_lag`` contributions ahead of the merges, with ``overrides`` (``--set KEY=VALUE``, as the CLI's)
    applied last.

    Raises:
        ConfigError: an override's syntax, or the config it makes (the product's own validation).
    """
    raw = base.model_dump()
    raw.update(run_id=run_id, store=f"file://{(out / 'runs').absolute()}", seed=seed)
    raw["data"].update(batch_size=sizes.batch_size)
    raw["diloco"].update(
        replicas=LEARNERS,
        min_replicas=2,
        rounds=sizes.rounds,
        sync_every=sizes.sync_every,
        quorum_grace_min_s=2.0,
        quorum_grace_max_s=10.0,
    )
    if mode == "decoupled":
        raw["diloco"].update(
            mode="decoupled",
            rounds=sizes.rounds * LEARNERS // MIN_QUORUM,
            decoupled={
                **raw["diloco"].get("decoupled", {}),
                "min_quorum": MIN_QUORUM,
                "grace_s": GRACE_S,
                "max_lag": max_lag,
                "keep_versions": None,  # nothing pruned: the accounting reads every contribution's header
            },
        )
    for override in overrides:
        apply_override(raw, override)
    raw["eval"].update(every_rounds=1, sequences=sizes.eval_sequences)
    raw["train"].update(warmup_steps=min(raw["train"]["warmup_steps"], sizes.sync_every))
    raw["executor"] = {"type": "local", "max_restarts": MAX_RESTARTS}
    return validate_config(raw, source=run_id)


def run_once(
    config: RunConfig,
    mode: str,
    scenario: Scenario,
    seed: int,
    sizes: Sizes,
    out: Path,
    mtbi_s: float = MTBI_S,
    cold_start_s: float = COLD_START_S,
) -> dict[str, Any]:
    """Launch ``config`` under ``scenario`` (preemptions every ``mtbi_s`` on average per learner, each
    restart held ``cold_start_s``) and account for it."""
    run = ObjectStore(config.store).child(config.run_id or "")
    start = time.time()
    kills = kill_times(seed, LEARNERS, mtbi_s, horizon_s=3600.0) if scenario.preempt else []
    injector = Injector(run, scenario, kills, start, cold_start_s)
    log = out / "launcher" / f"{config.run_id}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        injector.start()
        try:
            summary = launch(config, "goodput", Console(file=f, width=120))
        finally:
            injector.stop.set()
            injector.join()
    wall_s = time.time() - start
    if injector.error is not None:
        raise RuntimeError(f"the injector failed: {injector.error!r}") from injector.error
    assert summary is not None
    metrics = read_metrics(run)
    losses = {int(k): v for k, v in summary["eval_loss_by_round"].items()}
    scored_by_the_run = summary["final_eval_loss"]
    if mode == "decoupled":
        records, contributions, committed = read_decoupled(run, LEARNERS)
        acc = account_decoupled(metrics, records, contributions, committed)
        losses = score_versions(run, config, records)
    else:
        acc = account_lock_step(metrics)
    # the learners' lives only: decoupled's syncer (rank LEARNERS) trains nothing and is reported apart
    lives = injector.lives.values()
    alive = {rank: s for rank, s in lifetimes_s(injector.lives).items() if rank < LEARNERS}
    breakdown = alive_breakdown(
        {pid: life for pid, life in injector.lives.items() if life[0] < LEARNERS},
        injector.cold,
        {kill["pid"] for kill in injector.kills},
        metrics,
        acc.useful_s,
    )
    syncer_s = lifetimes_s(injector.lives).get(LEARNERS)
    dl = config.diloco
    step_tokens = next(
        (
            s["tokens"]
            for rows in metrics.values()
            for r in rows
            for s in r.get("step_rows", [])
            if s.get("tokens")
        ),
        None,
    )
    # lock-step's planned work, whichever the mode: the same token target for both
    target = TARGET_SHARE * sizes.rounds * dl.sync_every * LEARNERS * (step_tokens or 0.0)
    reached = time_to_tokens(acc.merges, target, start)
    at_target = loss_at_tokens(acc.tokens_at, losses, target) if reached else None
    step_s = {
        rank: [
            s["time_s"]["step"] - s["time_s"].get("sync", 0.0) for r in rows for s in r.get("step_rows", [])
        ]
        for rank, rows in metrics.items()
    }
    return {
        "run_id": config.run_id,
        "goodput": acc.useful_s / sum(alive.values()) if alive else None,
        "useful_s": round(acc.useful_s, 2),
        "alive_s": {str(r): round(s, 2) for r, s in sorted(alive.items())},
        # the learners' alive seconds by what they went to (alive_breakdown), and as shares of them
        "alive_breakdown_s": breakdown,
        "alive_shares": {k: round(v / sum(alive.values()), 4) for k, v in breakdown.items()}
        if alive
        else None,
        "executed_steps": acc.executed_steps,
        "merged_steps": acc.merged_steps,
        "target_tokens": target,
        "wall_s_to_tokens": round(reached[0], 2) if reached else None,
        "eval_loss_at_tokens": at_target[0] if at_target else None,
        "eval_tokens_at_tokens": at_target[1] if at_target else None,
        "final_eval_loss": losses[max(losses)] if losses else None,
        # the last global's loss as the run's own replicas scored it: decoupled's must be the one above
        "final_eval_loss_scored_by_the_run": scored_by_the_run,
        "globals": len(acc.merges),
        "evals": [
            [k, acc.tokens_at[k], round(acc.eval_time[k] - start, 2), losses[k]]
            for k in sorted(losses)
            if k in acc.tokens_at
        ],
        "staleness": {str(a): n for a, n in sorted(acc.staleness.items())},
        "step_time_estimated_contributions": acc.estimated,
        "mean_step_s_by_learner": {str(r): round(sum(v) / len(v), 4) for r, v in sorted(step_s.items()) if v},
        "kills": injector.kills,
        "kills_missed": injector.missed,
        "restarts": sum(1 for rank, _, _ in lives if rank < LEARNERS) - LEARNERS,
        "syncer_alive_s": round(syncer_s, 2) if syncer_s is not None else None,
        "wall_s": round(wall_s, 1),
    }


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bars, curves, by_tokens) = plt.subplots(1, 3, figsize=(16, 4.2), dpi=120)
    names = list(results)
    for i, mode in enumerate(MODES):
        values = [results[s].get(mode, {}).get("goodput") for s in names]
        xs = [j + (i - 0.5) * 0.38 for j in range(len(names))]
        bars.bar(
            [x for x, v in zip(xs, values, strict=True) if v is not None],
            [v for v in values if v is not None],
            width=0.36,
            label=mode if any(v is not None for v in values) else f"{mode} (not available)",
            color=f"C{i}",
        )
    bars.set_xticks(range(len(names)), [n.split(":")[0] for n in names])  # the scenario letters
    bars.set_ylim(0, 1)
    bars.set_ylabel("goodput")
    bars.legend(fontsize=8)
    bars.grid(alpha=0.3, axis="y")
    for j, scenario in enumerate(names):
        for i, mode in enumerate(MODES):
            evals = results[scenario].get(mode, {}).get("evals")
            if evals:
                _, tokens, seconds, losses = zip(*evals, strict=True)
                style = dict(linestyle="-" if i == 0 else "--", color=f"C{j + 2}", label=f"{scenario} {mode}")
                curves.plot(seconds, losses, **style)
                by_tokens.plot([t / 1000 for t in tokens], losses, **style)
    curves.set_xlabel("wall seconds since launch")
    by_tokens.set_xlabel("merged tokens (thousands)")
    for axes in (curves, by_tokens):
        axes.set_ylabel("held-out loss, global model")
        axes.grid(alpha=0.3)
        axes.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, required=True, help="directory for results.json, goodput.png, runs"
    )
    parser.add_argument("--config", default="deploy/configs/local-demo.toml", help="model, data, optimizers")
    parser.add_argument("--scenarios", default="abcd", help="which of a, b, c, d to run (default: all)")
    parser.add_argument("--modes", default=",".join(MODES), help="lock-step, decoupled or both")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model, the data and the preemptions")
    parser.add_argument("--rounds", type=int, default=12, help="outer rounds of each run")
    parser.add_argument("--sync-every", type=int, default=10, help="inner steps per round (H; the demo's)")
    parser.add_argument(
        "--batch-size", type=int, default=8, help="sequences per inner step per learner (the demo's)"
    )
    parser.add_argument("--eval-sequences", type=int, default=16, help="held-out sequences per evaluation")
    parser.add_argument(
        "--mtbi-s",
        type=float,
        default=MTBI_S,
        help="c, d: mean seconds between a learner's preemptions (an exponential gap, per learner)",
    )
    parser.add_argument(
        "--cold-start-s", type=float, default=COLD_START_S, help="c, d: seconds each restart is held stopped"
    )
    parser.add_argument(
        "--max-lag", type=int, default=MAX_LAG, help="decoupled learners' diloco.decoupled.max_lag"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a key of the decoupled side's config, as the CLI's --set (repeatable), e.g. "
        "--set diloco.decoupled.outer=delayed_nesterov",
    )
    parser.add_argument(
        "--lock-step-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="the same for the lock-step side, e.g. --lock-step-set diloco.embedding_average=all",
    )
    args = parser.parse_args(argv)
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} exists and is not a directory")
    if (args.out / "runs").is_dir() and any((args.out / "runs").iterdir()):
        parser.error(
            f"--out {args.out} already holds runs from an earlier invocation; choose a new directory"
        )
    if not args.scenarios or set(args.scenarios) - set(SCENARIOS):
        parser.error(f"--scenarios takes letters of {''.join(SCENARIOS)}, got {args.scenarios!r}")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or set(args.modes) - set(MODES):
        parser.error(f"--modes takes {', '.join(MODES)}, got {args.modes!r}")
    if (
        min(args.rounds, args.sync_every, args.batch_size, args.eval_sequences) < 1
        or min(args.seed, args.max_lag, args.cold_start_s) < 0
        or not args.mtbi_s > 0
    ):
        parser.error(
            "--rounds, --sync-every, --batch-size, --eval-sequences must be >= 1, --mtbi-s > 0 and --seed, "
            "--max-lag, --cold-start-s >= 0"
        )
    try:
        args.base = load_config(args.config)
    except ConfigError as e:
        parser.error(str(e))
    if args.base.train.objective != "lm":
        parser.error(f"{args.config}: train.objective must be 'lm' (held-out loss is the measure here)")
    args.sizes = Sizes(args.rounds, args.sync_every, args.batch_size, args.eval_sequences)
    # the overrides' configs, checked before anything runs or is written
    for mode, flag, overrides in (
        ("decoupled", "--set", args.set),
        ("lock-step", "--lock-step-set", args.lock_step_set),
    ):
        if mode in args.modes:
            try:
                run_config(
                    args.base,
                    args.sizes,
                    mode,
                    args.seed,
                    "set-check",
                    args.out,
                    args.max_lag,
                    tuple(overrides),
                )
            except ConfigError as e:
                parser.error(f"{flag}: {e}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    sizes = args.sizes
    command = " ".join(["python", "benchmarks/goodput.py", *(sys.argv[1:] if argv is None else argv)])
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    # every config first: one this commit refuses stops the benchmark before anything launches
    configs = {
        (letter, mode): run_config(
            args.base,
            sizes,
            mode,
            args.seed,
            f"{mode}-{letter}-s{args.seed}",
            args.out,
            args.max_lag,
            tuple(args.set) if mode == "decoupled" else tuple(args.lock_step_set),
        )
        for letter in args.scenarios
        for mode in args.modes
    }
    results: dict[str, dict[str, Any]] = {}
    for letter in args.scenarios:
        scenario = SCENARIOS[letter]
        results[scenario.name] = {}
        for mode in args.modes:
            row = run_once(
                configs[(letter, mode)],
                mode,
                scenario,
                args.seed,
                sizes,
                args.out,
                args.mtbi_s,
                args.cold_start_s,
            )
            results[scenario.name][mode] = row
            print(
                f"[{time.monotonic() - started:6.0f}s] {scenario.name:32s} {mode:9s} goodput {row['goodput']:.3f}  "
                f"to tokens {row['wall_s_to_tokens']}s  loss there {row['eval_loss_at_tokens']}  "
                f"kills {len(row['kills'])}  ({row['wall_s']:.0f}s)",
                flush=True,
            )
        if set(MODES) <= set(results[scenario.name]):
            both = results[scenario.name]
            compared = at_equal_tokens(both["lock-step"]["evals"], both["decoupled"]["evals"])
            both["at_equal_tokens"] = compared
            print(f"{scenario.name:32s} at equal tokens: {json.dumps(compared)}", flush=True)
    result = {
        "command": command,
        "sizes": asdict(sizes),
        "learners": LEARNERS,
        "seed": args.seed,
        "injection": {
            "slow_rank": SLOW_RANK,
            "throttle_period_s": THROTTLE_PERIOD_S,
            "mtbi_s": args.mtbi_s,
            "cold_start_s": args.cold_start_s,
            "target_share": TARGET_SHARE,
        },
        "decoupled": {
            "min_quorum": MIN_QUORUM,
            "grace_s": GRACE_S,
            "max_lag": args.max_lag,
            "versions": sizes.rounds * LEARNERS // MIN_QUORUM,
            "set": args.set,
            "other settings": "the defaults of diloco.decoupled, but those set",
        },
        "lock_step": {"set": args.lock_step_set},
        "results": results,
        "wall_s": round(time.monotonic() - started, 1),
    }
    (args.out / "results.json").write_text(json.dumps(result, indent=2))
    plot(results, args.out / "goodput.png")
    print(f"wrote {args.out / 'results.json'} in {result['wall_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
