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
- ``c``: preemptions: each learner is SIGKILLed at random times (exponential gaps of mean ``MTBI_S``,
  drawn with the seed), and each restarted process is held stopped for ``COLD_START_S`` before it may run,
  as a cloud replica waits for its container (on top of the restart's own model load).
- ``d``: b and c together.

Reported per run, from the learners' own metrics rows (``metrics/{rank}/{k}.json``) and their processes'
lifetimes (sampled every ``POLL_S``):

- ``goodput``: the share of the learners' alive time (every process's life, start to death or exit, a cold
  start's hold included: a cloud bills it) spent on inner steps whose work reached a merged global: the
  steps' own time (``time_s.step`` minus the part blocked in a sync) in the rows of the rounds each learner
  was a participant of.
- ``wall_s_to_tokens``: seconds from the launch until the merged globals hold ``TARGET_SHARE`` of the tokens
  the run plans (rounds x H x N x tokens per step): every scenario can reach it with some learners lost.
- ``eval_loss_at_tokens``: held-out loss of the first global holding that many tokens.
- ``staleness``: how many versions old each merged contribution was (lock-step: always 0, every round
  starts from the last global).

The decoupled side launches ``diloco.mode = "decoupled"``; on a commit whose config has no such mode, or
whose merge record this benchmark does not read yet (``ACCOUNTING``), it is reported as not available, with
why, and no figure is made up for it.

Writes ``results.json`` and ``goodput.png`` (goodput per scenario and mode; held-out loss against wall time).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console

from composer_serverless.config import ConfigError, RunConfig, load_config, validate_config
from composer_serverless.executors.base import LaunchRecord
from composer_serverless.launch.launcher import launch
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import read_metrics

LEARNERS = 4
SLOW_RANK = 3
THROTTLE_PERIOD_S = 0.2
MTBI_S = 20.0
COLD_START_S = 8.0
TARGET_SHARE = 0.75
POLL_S = 0.05
MAX_RESTARTS = 10  # per learner: the executor's limit
MODES = ("lock-step", "decoupled")


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
    staleness: Counter[int] = field(default_factory=Counter)


def _inner_seconds(row: dict[str, Any]) -> float:
    """A round's inner steps' own time: each step's time less the part it was held in a sync."""
    return sum(s["time_s"]["step"] - s["time_s"].get("sync", 0.0) for s in row.get("step_rows", []))


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
        acc.staleness[0] += len(rows)
    return acc


# How each mode's merged work is read from the store. The decoupled mode's comes with its syncer's record of
# what each version merged (the contributions, their base versions and tokens), which this commit lacks.
ACCOUNTING = {"lock-step": account_lock_step}


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


# --- the injector ---------------------------------------------------------------------------------------


class Injector(threading.Thread):
    """Watches the run's learner processes (the launch record's pids), records their lifetimes, and injects
    the scenario: the throttle of the slow learner, the preemptions, the cold-start hold of restarts."""

    def __init__(
        self, run: ObjectStore, scenario: Scenario, kills: list[tuple[float, int]], start: float
    ) -> None:
        super().__init__(name="injector", daemon=True)
        self.run_store = run
        self.scenario = scenario
        self.pending = list(kills)
        self.start_time = start
        self.stop = threading.Event()
        self.lives: dict[int, tuple[int, float, float]] = {}  # pid -> (rank, started, last seen alive)
        self.held: dict[int, float] = {}  # pid -> when its cold start ends
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
                        self.held[pid] = now + COLD_START_S
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


def run_config(base: RunConfig, sizes: Sizes, mode: str, seed: int, run_id: str, out: Path) -> RunConfig:
    """The demo's config at ``sizes`` in ``mode``. Lock-step waits for stragglers as the chaos soak does (a
    quorum of 2, a grace of 2 to 10 s); raises ConfigError where this commit has no such mode."""
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
        raw["diloco"]["mode"] = "decoupled"
    raw["eval"].update(every_rounds=1, sequences=sizes.eval_sequences)
    raw["train"].update(warmup_steps=min(raw["train"]["warmup_steps"], sizes.sync_every))
    raw["executor"] = {"type": "local", "max_restarts": MAX_RESTARTS}
    return validate_config(raw, source=run_id)


def run_once(config: RunConfig, mode: str, scenario: Scenario, seed: int, out: Path) -> dict[str, Any]:
    """Launch ``config`` under ``scenario`` and account for it."""
    run = ObjectStore(config.store).child(config.run_id or "")
    start = time.time()
    kills = kill_times(seed, LEARNERS, MTBI_S, horizon_s=3600.0) if scenario.preempt else []
    injector = Injector(run, scenario, kills, start)
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
    acc = ACCOUNTING[mode](metrics)
    alive = lifetimes_s(injector.lives)
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
    target = TARGET_SHARE * dl.rounds * dl.sync_every * LEARNERS * (step_tokens or 0.0)
    reached = time_to_tokens(acc.merges, target, start)
    losses = {int(k): v for k, v in summary["eval_loss_by_round"].items()}
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
        "executed_steps": acc.executed_steps,
        "merged_steps": acc.merged_steps,
        "target_tokens": target,
        "wall_s_to_tokens": round(reached[0], 2) if reached else None,
        "eval_loss_at_tokens": losses.get(reached[1]) if reached else None,
        "final_eval_loss": summary["final_eval_loss"],
        "eval_loss_by_time": [
            [round(acc.eval_time[k] - start, 2), losses[k]] for k in sorted(losses) if k in acc.eval_time
        ],
        "staleness": {str(a): n for a, n in sorted(acc.staleness.items())},
        "mean_step_s_by_learner": {str(r): round(sum(v) / len(v), 4) for r, v in sorted(step_s.items()) if v},
        "kills": injector.kills,
        "kills_missed": injector.missed,
        "restarts": len(injector.lives) - LEARNERS,
        "wall_s": round(wall_s, 1),
    }


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bars, curves) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=120)
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
    bars.set_xticks(range(len(names)), names)
    bars.set_ylim(0, 1)
    bars.set_ylabel("goodput")
    bars.legend(fontsize=8)
    bars.grid(alpha=0.3, axis="y")
    for j, scenario in enumerate(names):
        for i, mode in enumerate(MODES):
            row = results[scenario].get(mode, {})
            if row.get("eval_loss_by_time"):
                style = "-" if i == 0 else "--"
                curves.plot(
                    *zip(*row["eval_loss_by_time"], strict=True),
                    style,
                    color=f"C{j + 2}",
                    label=f"{scenario} {mode}",
                )
    curves.set_xlabel("wall seconds since launch")
    curves.set_ylabel("held-out loss, global model")
    curves.grid(alpha=0.3)
    curves.legend(fontsize=7)
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
    if min(args.rounds, args.sync_every, args.batch_size, args.eval_sequences) < 1 or args.seed < 0:
        parser.error("--rounds, --sync-every, --batch-size, --eval-sequences must be >= 1 and --seed >= 0")
    try:
        args.base = load_config(args.config)
    except ConfigError as e:
        parser.error(str(e))
    if args.base.train.objective != "lm":
        parser.error(f"{args.config}: train.objective must be 'lm' (held-out loss is the measure here)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    sizes = Sizes(args.rounds, args.sync_every, args.batch_size, args.eval_sequences)
    command = " ".join(["python", "benchmarks/goodput.py", *(sys.argv[1:] if argv is None else argv)])
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results: dict[str, dict[str, Any]] = {}
    for letter in args.scenarios:
        scenario = SCENARIOS[letter]
        results[scenario.name] = {}
        for mode in args.modes:
            try:
                config = run_config(
                    args.base, sizes, mode, args.seed, f"{mode}-{letter}-s{args.seed}", args.out
                )
            except ConfigError as e:
                if mode != "decoupled":
                    raise
                why = " ".join(line.strip() for line in str(e).splitlines()[1:2])
                results[scenario.name][mode] = {
                    "available": False,
                    "why": f"not available on this commit ({why})",
                }
                print(f"decoupled: {results[scenario.name][mode]['why']}", flush=True)
                continue
            if mode not in ACCOUNTING:
                why = "not available: the mode launches, but this benchmark does not read its syncer's merge record yet"
                results[scenario.name][mode] = {"available": False, "why": why}
                print(f"{mode}: {why}", flush=True)
                continue
            row = run_once(config, mode, scenario, args.seed, args.out)
            results[scenario.name][mode] = {"available": True, **row}
            print(
                f"[{time.monotonic() - started:6.0f}s] {scenario.name:32s} {mode:9s} goodput {row['goodput']:.3f}  "
                f"to tokens {row['wall_s_to_tokens']}s  loss there {row['eval_loss_at_tokens']}  "
                f"kills {len(row['kills'])}  ({row['wall_s']:.0f}s)",
                flush=True,
            )
    result = {
        "command": command,
        "sizes": asdict(sizes),
        "learners": LEARNERS,
        "seed": args.seed,
        "injection": {
            "slow_rank": SLOW_RANK,
            "throttle_period_s": THROTTLE_PERIOD_S,
            "mtbi_s": MTBI_S,
            "cold_start_s": COLD_START_S,
            "target_share": TARGET_SHARE,
        },
        "results": results,
        "wall_s": round(time.monotonic() - started, 1),
    }
    (args.out / "results.json").write_text(json.dumps(result, indent=2))
    plot(results, args.out / "goodput.png")
    print(f"wrote {args.out / 'results.json'} in {result['wall_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
