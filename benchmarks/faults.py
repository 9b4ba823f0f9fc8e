"""DiLoCo while replicas die: 4 replicas, one killed with SIGKILL (and restarted) in a third of the rounds.

    python benchmarks/faults.py --out bench-out/faults            # the demo config: 36 rounds, 12 kills
    python benchmarks/faults.py --out bench-out/faults-quick --quick   # 15 rounds, 5 kills

Two launches of the same config and seed, one after the other, each through ``launcher.launch`` (local
replica processes, a ``file://`` store under ``--out``, the supervisor starting dead replicas again as it
does for any run, up to ``executor.max_restarts``):

1. fault-free;
2. faulty: before the run, a third of the rounds is drawn with the seed (never the first or the last). In
   each, one replica process is killed with SIGKILL the moment its first pseudo-gradient shard of that round
   lands in the store: after it ran all H inner steps of the round, with its exchange in flight, the
   costliest moment to lose it. The victim rotates over the ranks: kill i targets rank i mod N, or the next
   rank that is training that round (its heartbeat announces each round as it starts) or is already in its
   exchange, and has not finished the round; when none is (all restarting, waiting or done) before the round
   is published, the kill moves to the next round, and is reported under ``missed_kills``. The supervisor
   sees the death at its next poll and starts the replica again; the new process resumes from the store's
   LATEST state and its own last saved state. Both runs use ``min_replicas = 2``: a round averages whoever arrived within the
   straggler grace.

Figures, from the store alone:

- ``rounds``: the run's outer rounds; ``committed``: rounds whose global update was published;
  ``commit_rate`` = committed / rounds.
- ``goodput``: inner steps that ended in a committed global update (H for each participant of each committed
  round) / every inner step the replica processes ran: the ``steps`` of every metrics row (including rounds a
  replica trained without contributing, and steps discarded when it jumped to a published state), plus the
  H steps of the round each killed process was in, which it never recorded. The time a dead replica spends
  restarting is not counted as steps; it shows as ``participation`` (mean participants / N over rounds) and
  in the wall time.
- ``final_eval_loss`` (faulty run) and ``fault_free_eval_loss``: held-out loss of the final global model.

Writes ``results.json`` and ``faults.png`` (eval loss per round of both runs, the kills, and the participants).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console

from composer_serverless.config import ConfigError, RunConfig, load_config, validate_config
from composer_serverless.executors.base import LaunchRecord
from composer_serverless.launch.launcher import launch
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.latest import latest_round
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import read_heartbeats, read_metrics

MAX_RESTARTS = 10
POLL_S = 0.002


@dataclass(frozen=True)
class Budget:
    """Outer rounds of H inner steps (the config's H) of ``batch_size`` sequences of ``seq_len`` tokens per
    replica; a round averages at least ``min_replicas`` of the ``replicas``."""

    rounds: int
    seq_len: int
    batch_size: int
    replicas: int = 4
    min_replicas: int = 2


# The demo's per-step work (deploy/configs/local-demo.toml); quick runs half its rounds.
FULL = Budget(rounds=36, seq_len=128, batch_size=8)
QUICK = Budget(rounds=15, seq_len=128, batch_size=8)


# --- the rule and the arithmetic (pure; tested with hand-computed numbers) -----------------------------


def kill_rounds(rounds: int, seed: int) -> list[int]:
    """A third of the rounds (rounded down), drawn with ``seed`` from 2..rounds-1: never the first round
    (replicas are still starting) nor the last (nothing would be left to recover into)."""
    candidates = list(range(2, rounds))
    return sorted(random.Random(seed).sample(candidates, min(len(candidates), rounds // 3)))


def victim_order(kill_index: int, replicas: int) -> list[int]:
    """Ranks in the order kill ``kill_index`` tries them: rank kill_index mod N first, then on round-robin."""
    return [(kill_index + j) % replicas for j in range(replicas)]


@dataclass
class Accounting:
    """What the store says about a run's rounds and inner steps."""

    rounds: int
    committed: int
    useful_steps: int
    executed_steps: int
    participants: dict[int, list[int]] = field(default_factory=dict)

    @property
    def commit_rate(self) -> float:
        return self.committed / self.rounds

    @property
    def goodput(self) -> float:
        return self.useful_steps / self.executed_steps if self.executed_steps else 0.0

    def participation(self, replicas: int) -> float:
        counts = [len(p) for p in self.participants.values()]
        return sum(counts) / (len(counts) * replicas) if counts else 0.0


def account(
    metrics: dict[int, list[dict[str, Any]]], rounds: int, sync_every: int, unrecorded_steps: int
) -> Accounting:
    """Rounds committed and inner steps useful / executed, from every replica's per-round metrics rows.

    ``unrecorded_steps``: steps run by processes that died before writing a row for them (the benchmark
    knows how many: H per kill that landed before the victim recorded its round).
    """
    participants: dict[int, list[int]] = {}
    executed = unrecorded_steps
    for rows in metrics.values():
        for row in rows:
            executed += row.get("steps", 0)
            if row["round"] > 0 and "participants" in row:
                participants[row["round"]] = row["participants"]
    committed = {k: p for k, p in participants.items() if 1 <= k <= rounds}
    useful = sum(sync_every * len(p) for p in committed.values())
    return Accounting(rounds, len(committed), useful, executed, dict(sorted(committed.items())))


# --- the killer ---------------------------------------------------------------------------------------


class Killer(threading.Thread):
    """Kills one replica process per drawn round, by the rule in the module docstring, and records each kill."""

    def __init__(self, run: ObjectStore, rounds: list[int], replicas: int, last_round: int) -> None:
        super().__init__(name="killer", daemon=True)
        if run.local_dir(layout.ROUNDS) is None:
            raise ValueError("the fault benchmark kills local processes; its store must be a local directory")
        self.run_store = run
        self.rounds = rounds
        self.replicas = replicas
        self.last_round = last_round
        self.stop = threading.Event()
        self.kills: list[dict[str, Any]] = []
        self.missed: list[dict[str, Any]] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            pending = list(self.rounds)
            while pending and not self.stop.is_set():
                round_index = pending.pop(0)
                if self._kill_in(len(self.kills), round_index) or self.stop.is_set():
                    continue
                # No victim in time (every replica was restarting, waiting or done): the kill moves to the
                # next round without one, so the run still loses a replica in as many rounds.
                later = next((k for k in range(round_index + 1, self.last_round) if k not in pending), None)
                self.missed.append({"round": round_index, "moved_to": later})
                if later is not None:
                    pending = sorted([*pending, later])
        except BaseException as e:  # reported by the benchmark after the launch returns
            self.error = e

    def _kill_in(self, i: int, round_index: int) -> bool:
        """Kill a replica in ``round_index``; False if the round was published before a victim was found."""
        while not self.stop.is_set():
            if latest_round(self.run_store) >= round_index:
                return False
            victim = self._choose(i, round_index)
            if victim is None:
                time.sleep(POLL_S)
                continue
            rank, pid = victim
            while not self.stop.is_set():
                if rank in self._uploaded(round_index):
                    os.kill(pid, signal.SIGKILL)
                    killed_at = time.time()
                    _wait_dead(pid)
                    recorded = self.run_store.exists(layout.metrics(rank, round_index))
                    self.kills.append(
                        {
                            "round": round_index,
                            "rank": rank,
                            "pid": pid,
                            "time": killed_at,
                            "recorded_round": recorded,
                        }
                    )
                    return True
                if not _alive(pid) or latest_round(self.run_store) >= round_index:
                    break  # it died or was left out on its own; choose again (or miss the round)
                time.sleep(POLL_S)
        return False

    def _uploaded(self, round_index: int) -> set[int]:
        """Ranks with a pseudo-gradient shard of ``round_index`` in the store."""
        inputs = f"{layout.sync(round_index, 0)}/{layout.sync_inputs(0)}"
        return {int(name.split("-")[0]) for name in self.run_store.list(inputs)}

    def _choose(self, i: int, round_index: int) -> tuple[int, int] | None:
        """The first live rank in rotation order that is in ``round_index`` and has not finished it: one whose
        heartbeat says it trains the round (a replica announces each new round at once), or one that already
        uploaded its shard (it is in the exchange, and is killed at once)."""
        try:
            handles = {
                h.rank: h for h in LaunchRecord.from_json(self.run_store.get(layout.LAUNCH_RECORD)).current()
            }
        except FileNotFoundError:
            return None
        beats = read_heartbeats(self.run_store)
        uploaded = self._uploaded(round_index)
        for rank in victim_order(i, self.replicas):
            handle, beat = handles.get(rank), beats.get(rank, {})
            if handle is None or not handle.created or not _alive(int(handle.backend_id)):
                continue  # (an attempt being started has no pid yet)
            if self.run_store.exists(layout.metrics(rank, round_index)):
                continue
            training = beat.get("state") == "training" and beat.get("round") == round_index
            if training or rank in uploaded:
                return rank, int(handle.backend_id)
        return None


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by the supervisor, does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _wait_dead(pid: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.005)


# --- the runs -----------------------------------------------------------------------------------------


def run_config(base: RunConfig, budget: Budget, seed: int, run_id: str, out: Path) -> RunConfig:
    raw = base.model_dump()
    raw.update(run_id=run_id, store=f"file://{(out / 'runs').absolute()}", seed=seed)
    raw["data"].update(seq_len=budget.seq_len, batch_size=budget.batch_size)
    raw["diloco"].update(replicas=budget.replicas, min_replicas=budget.min_replicas, rounds=budget.rounds)
    raw["eval"].update(every_rounds=1)
    raw["executor"] = {"type": "local", "max_restarts": MAX_RESTARTS}
    return validate_config(raw, source=run_id)


def run_once(config: RunConfig, out: Path, kills: list[int]) -> dict[str, Any]:
    """Launch ``config`` (killing by rule in ``kills``) and account for it from the store."""
    run = ObjectStore(config.store).child(config.run_id or "")
    killer = Killer(run, kills, config.diloco.replicas, config.diloco.rounds) if kills else None
    log = out / "launcher" / f"{config.run_id}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(log, "w") as f:
        if killer is not None:
            killer.start()
        try:
            summary = launch(config, "faults", Console(file=f, width=120))
        finally:
            if killer is not None:
                killer.stop.set()
                killer.join()
    wall_s = time.monotonic() - started
    assert summary is not None
    if killer is not None and killer.error is not None:
        raise RuntimeError(f"the killer failed: {killer.error!r}") from killer.error
    dl = config.diloco
    done = killer.kills if killer else []
    unrecorded = sum(dl.sync_every for k in done if not k["recorded_round"])
    metrics = read_metrics(run)
    acc = account(metrics, dl.rounds, dl.sync_every, unrecorded)
    logs = run.local_dir("logs")
    failed_syncs = (
        sum(p.read_text(errors="replace").count(" FAILED: ") for p in logs.glob("*.log")) if logs else None
    )
    return {
        "run_id": config.run_id,
        "rounds": acc.rounds,
        "committed": acc.committed,
        "commit_rate": acc.commit_rate,
        "goodput": acc.goodput,
        "useful_steps": acc.useful_steps,
        "executed_steps": acc.executed_steps,
        "unrecorded_steps": unrecorded,
        "participation": acc.participation(dl.replicas),
        "participants_by_round": {str(k): v for k, v in acc.participants.items()},
        "final_eval_loss": summary["final_eval_loss"],
        "eval_loss_by_round": summary["eval_loss_by_round"],
        "replicas_bit_identical": summary["replicas_bit_identical"],
        "failed_syncs": failed_syncs,
        "kills": [_with_rejoin(k, metrics) for k in done],
        "missed_kills": killer.missed if killer else [],
        "wall_s": round(wall_s, 1),
    }


def _with_rejoin(kill: dict[str, Any], metrics: dict[int, list[dict[str, Any]]]) -> dict[str, Any]:
    """The kill, with the first round the restarted replica contributed to and how long that took."""
    back = [
        r
        for r in metrics.get(kill["rank"], [])
        if r["round"] > kill["round"]
        and kill["rank"] in r.get("participants", [])
        and r["time"] > kill["time"]
    ]
    first = min(back, key=lambda r: r["round"], default=None)
    return {
        "round": kill["round"],
        "rank": kill["rank"],
        "recorded_round": kill["recorded_round"],
        "contributes_again_in_round": first["round"] if first else None,
        "back_after_s": round(first["time"] - kill["time"], 1) if first else None,
    }


def plot(clean: dict[str, Any], faulty: dict[str, Any], replicas: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, part_ax) = plt.subplots(
        2, 1, figsize=(7.5, 5.5), dpi=120, sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    for row, label, style in ((clean, "fault-free", "k-"), (faulty, "faulty", "C3-")):
        points = sorted((int(k), v) for k, v in row["eval_loss_by_round"].items())
        loss_ax.plot(
            *zip(*points, strict=True), style, marker=".", label=f"{label}: {row['final_eval_loss']:.4f}"
        )
    for i, kill in enumerate(faulty["kills"]):
        loss_ax.axvline(
            kill["round"], color="C3", alpha=0.25, lw=1, label="a replica killed" if i == 0 else None
        )
    loss_ax.set_ylabel("held-out loss, global model")
    low = min(clean["final_eval_loss"], faulty["final_eval_loss"])
    loss_ax.set_ylim(low - 0.1, low + 2.0)
    loss_ax.grid(alpha=0.3)
    loss_ax.legend(fontsize=8)
    rounds = sorted(int(k) for k in faulty["participants_by_round"])
    part_ax.step(rounds, [len(faulty["participants_by_round"][str(k)]) for k in rounds], "C3-", where="mid")
    part_ax.set_ylim(0, replicas + 0.5)
    part_ax.set_ylabel("participants")
    part_ax.set_xlabel("outer round")
    part_ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# --- the command --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, required=True, help="directory for results.json, faults.png and the runs"
    )
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK.rounds} rounds instead of {FULL.rounds}"
    )
    parser.add_argument(
        "--config", default="deploy/configs/local-demo.toml", help="model, data, optimizers, H"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the model, the data and the kill rounds")
    parser.add_argument(
        "--rounds", type=int, default=None, help="outer rounds (default: 36, or 15 with --quick)"
    )
    args = parser.parse_args(argv)
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} exists and is not a directory")
    if (args.out / "runs").is_dir() and any((args.out / "runs").iterdir()):
        parser.error(
            f"--out {args.out} already holds runs from an earlier invocation; choose a new directory"
        )
    if args.seed < 0:
        parser.error("--seed must be >= 0")
    if args.rounds is not None and args.rounds < 3:
        parser.error("--rounds must be at least 3 (kills avoid the first and the last round)")
    try:
        args.base = load_config(args.config)
    except ConfigError as e:
        parser.error(str(e))
    if args.base.train.objective != "lm":
        parser.error(f"{args.config}: train.objective must be 'lm' (held-out loss is the measure here)")
    if args.base.executor.type != "local":
        parser.error(
            f"{args.config}: the fault benchmark kills local processes; executor.type must be 'local'"
        )
    return args


def run(base: RunConfig, budget: Budget, seed: int, out: Path, command: str = "") -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    kills = kill_rounds(budget.rounds, seed)
    results = {}
    for name, rounds_to_kill in (("fault-free", []), ("faulty", kills)):
        config = run_config(base, budget, seed, f"{name}-s{seed}", out)
        results[name] = run_once(config, out, rounds_to_kill)
        row = results[name]
        print(
            f"[{time.monotonic() - started:6.0f}s] {name:10s} eval loss {row['final_eval_loss']:.4f}  committed "
            f"{row['committed']}/{row['rounds']}  goodput {row['goodput']:.3f}  kills {len(row['kills'])}  "
            f"({row['wall_s']:.0f}s)",
            flush=True,
        )
    clean, faulty = results["fault-free"], results["faulty"]
    result = {
        "command": command,
        "budget": asdict(budget),
        "sync_every": base.diloco.sync_every,
        "seed": seed,
        "kill_rounds": kills,
        "rounds": faulty["rounds"],
        "committed": faulty["committed"],
        "commit_rate": faulty["commit_rate"],
        "goodput": faulty["goodput"],
        "final_eval_loss": faulty["final_eval_loss"],
        "fault_free_eval_loss": clean["final_eval_loss"],
        "eval_gap_vs_fault_free": faulty["final_eval_loss"] / clean["final_eval_loss"] - 1,
        "checks": {
            "commit_rate_at_least_90pct": {
                "value": faulty["commit_rate"],
                "met": faulty["commit_rate"] >= 0.9,
            },
            "final_loss_within_2pct_of_fault_free": {
                "value": faulty["final_eval_loss"] / clean["final_eval_loss"] - 1,
                "met": faulty["final_eval_loss"] <= clean["final_eval_loss"] * 1.02,
            },
        },
        "wall_s": round(time.monotonic() - started, 1),
        "runs": results,
    }
    (out / "results.json").write_text(json.dumps(result, indent=2))
    plot(clean, faulty, budget.replicas, out / "faults.png")
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    budget = QUICK if args.quick else FULL
    if args.rounds is not None:
        budget = dataclasses.replace(budget, rounds=args.rounds)
    command = " ".join(["python", "benchmarks/faults.py", *(sys.argv[1:] if argv is None else argv)])
    result = run(args.base, budget, args.seed, args.out, command)
    for key in ("rounds", "committed", "commit_rate", "goodput", "final_eval_loss", "fault_free_eval_loss"):
        print(f"{key:22s} {result[key]}")
    for name, check in result["checks"].items():
        print(f"{'met' if check['met'] else 'NOT met':8s} {name}: {check['value']:+.4f}")
    print(f"wrote {args.out / 'results.json'} in {result['wall_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
