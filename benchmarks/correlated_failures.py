"""Correlated failures: every replica lost at once, and a poisoned contribution, against an undisturbed run.

    python benchmarks/correlated_failures.py --out bench-out/correlated          # 8 rounds of the demo's steps
    python benchmarks/correlated_failures.py --out bench-out/correlated --rounds 12

Launches of one config and seed (the demo's model, data and optimizers; 4 replicas, every round averaging all
4 so that a run's result does not depend on the machine's timing), each through ``launcher.launch`` with
local replica processes and the supervisor's own restarts:

1. ``clean``: undisturbed, on a local directory.
2. ``kill_all``: every replica SIGKILLed together as soon as all of them train round 4 (``checkpoint_every``
   10: no checkpoint yet). The launcher starts them again; they find nobody holding the round they wait
   for and roll the run back by themselves (``rendezvous/recovery.py``).
3. ``kill_all_checkpointed``: ``checkpoint_every`` 3, every replica killed in round 6: the rollback goes to
   round 3's checkpoint. (A kill in the round right after a checkpoint needs no rollback: the restarted
   replicas load the checkpoint and redo that round from the exchange objects still in the store.)
4. ``kill_all_s3``: ``kill_all`` on a real S3 server (moto, on loopback).
5. ``poisoned``: replica 1's input of shard 0 in round 3 replaced, before replica 1 writes it, by one of
   the right size holding 1e30 in every value with a valid checksum (as a replica whose own update blew up
   would write it): the robust average leaves it out (``rendezvous/robust.py``).

Per run: ``final_eval_loss`` (held-out loss of the final global model), its ratio to ``clean``'s, rounds
committed, the rollbacks with their redone rounds, the rounds that left a contribution out, wall time. The
checks of the issue: every run completes all rounds; killed runs end within 2 % of ``clean``, the poisoned
run within 1 %. Writes ``results.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from composer_serverless.config import ConfigError, RunConfig, load_config, validate_config
from composer_serverless.executors.base import LaunchRecord
from composer_serverless.launch.launcher import launch
from composer_serverless.rendezvous import layout, recovery
from composer_serverless.rendezvous.codec import NORM, encode, l2_norm
from composer_serverless.rendezvous.sharding import shard_bounds
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import read_heartbeats, read_metrics

REPLICAS = 4
MAX_RESTARTS = 2
KILL_IN = 4
CHECKPOINTED_KILL_IN, CHECKPOINT_EVERY = 6, 3
POISONED_ROUND, POISONED_RANK = 3, 1
POLL_S = 0.02
WAIT_S = 900.0


# --- what happens to a run while it trains ---------------------------------------------------------------


def kill_all_in(run: ObjectStore, round_index: int, replicas: int, done: list[dict[str, Any]]) -> None:
    """SIGKILL every replica process together once all ``replicas`` train ``round_index``."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        beats = read_heartbeats(run) if run.exists(layout.MEMBERS) else {}
        if (
            sum(b.get("state") == "training" and b.get("round") == round_index for b in beats.values())
            == replicas
        ):
            handles = LaunchRecord.from_json(run.get(layout.LAUNCH_RECORD)).current()
            for handle in handles:
                os.kill(int(handle.backend_id), signal.SIGKILL)
            done.append(
                {"round": round_index, "pids": [int(h.backend_id) for h in handles], "time": time.time()}
            )
            return
        time.sleep(POLL_S)


def poison(run: ObjectStore, round_index: int, rank: int, replicas: int, done: list[dict[str, Any]]) -> None:
    """Write ``rank``'s input of shard 0 for ``round_index`` before it does: every value 1e30, a valid
    checksum, and (as its writer would state) the norm of those values. Written once every replica trains
    the round before, so the run exists and nobody has reached the round yet."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        beats = read_heartbeats(run) if run.exists(layout.MEMBERS) else {}
        if len(beats) == replicas and all(b.get("round", 0) >= round_index - 1 for b in beats.values()):
            break
        time.sleep(POLL_S)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run.local_dir(layout.MODEL))
    numel = sum(p.numel() for p in model.parameters())
    start, end = shard_bounds(numel, replicas)[0]
    values = torch.full((end - start,), 1e30)
    identity = {
        "run_id": run.url.rsplit("/", 1)[-1],
        "round": str(round_index),
        "fragment": "0",
        "local": "0",
        "rank": str(rank),
        "shard": "0",
        NORM: repr(l2_norm(values)),
    }
    key = f"{layout.sync(round_index, 0)}/{layout.sync_input(rank, 0)}"
    created = run.create(key, encode(values, identity, "fp32"))
    done.append({"round": round_index, "rank": rank, "key": key, "written_first": created})


# --- the runs -----------------------------------------------------------------------------------------


@contextlib.contextmanager
def s3_store() -> Iterator[str]:
    """A moto S3 server on loopback with one bucket; its URL prefix. The replicas find it through the
    environment, as they would find AWS."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # the server's line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL_S3": endpoint,
    }
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
        yield "s3://bench/runs"
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        server.stop()


def configured(base: RunConfig, rounds: int, seed: int, run_id: str, store: str, **diloco: Any) -> RunConfig:
    """``base`` (its model, data, optimizers and H) with ``REPLICAS`` local replicas the launcher starts again
    when they die, every round averaging all of them, evaluated every round; ``diloco`` on top."""
    raw = base.model_dump()
    raw.update(run_id=run_id, store=store, seed=seed)
    raw["diloco"].update(replicas=REPLICAS, min_replicas=REPLICAS, rounds=rounds, **diloco)
    raw["eval"].update(every_rounds=1)
    raw["executor"] = {"type": "local", "max_restarts": MAX_RESTARTS}
    return validate_config(raw, source=run_id)


def run_once(
    config: RunConfig, out: Path, disturb: Callable[[ObjectStore, list[dict[str, Any]]], None] | None
) -> dict[str, Any]:
    """Launch ``config`` while ``disturb`` (in a thread) does its damage; the figures from the store."""
    run = ObjectStore(config.store).child(config.run_id or "")
    events: list[dict[str, Any]] = []
    thread = threading.Thread(target=disturb, args=(run, events), daemon=True) if disturb else None
    log = out / "launcher" / f"{config.run_id}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(log, "w") as f:
        if thread is not None:
            thread.start()
        summary = launch(config, "correlated_failures", Console(file=f, width=160))
    wall_s = time.monotonic() - started
    if thread is not None:
        thread.join(timeout=10)
    assert summary is not None
    rows = [r for rows in read_metrics(run).values() for r in rows if r["round"] > 0]
    left_out = sorted({(r["round"], tuple(r["rejected"])) for r in rows if r.get("rejected")})
    return {
        "run_id": config.run_id,
        "store": run.url,
        "rounds_committed": summary["rounds_committed"],
        "final_eval_loss": summary["final_eval_loss"],
        "replicas_bit_identical": summary["replicas_bit_identical"],
        "rollbacks": [
            {"waited_for": r.waited_for, "to": r.to, "redone": r.redone} for r in recovery.rollbacks(run)
        ],
        "rounds_redone": summary["rounds_redone"],
        "left_out": [{"round": k, "ranks": list(ranks)} for k, ranks in left_out],
        "events": events,
        "wall_s": round(wall_s, 1),
    }


def run(base: RunConfig, rounds: int, seed: int, out: Path, command: str) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    n = REPLICAS

    def kill(run: ObjectStore, events: list[dict[str, Any]]) -> None:
        kill_all_in(run, KILL_IN, n, events)

    def kill_later(run: ObjectStore, events: list[dict[str, Any]]) -> None:
        kill_all_in(run, CHECKPOINTED_KILL_IN, n, events)

    def poisoned(run: ObjectStore, events: list[dict[str, Any]]) -> None:
        poison(run, POISONED_ROUND, POISONED_RANK, n, events)

    file_store = f"file://{(out / 'runs').absolute()}"
    plans: list[tuple[str, str | None, dict[str, Any], Any]] = [
        ("clean", file_store, {}, None),
        ("kill_all", file_store, {}, kill),
        ("kill_all_checkpointed", file_store, {"checkpoint_every": CHECKPOINT_EVERY}, kill_later),
        ("kill_all_s3", None, {}, kill),
        ("poisoned", file_store, {}, poisoned),
    ]
    results: dict[str, dict[str, Any]] = {}
    for name, store, diloco, disturb in plans:
        with contextlib.ExitStack() as stack:
            where = store if store is not None else stack.enter_context(s3_store())
            config = configured(base, rounds, seed, f"{name.replace('_', '-')}-s{seed}", where, **diloco)
            results[name] = run_once(config, out, disturb)
        row = results[name]
        print(
            f"[{time.monotonic() - started:6.0f}s] {name:22s} eval loss {row['final_eval_loss']:.4f}  rounds "
            f"{row['rounds_committed']}/{rounds}  rollbacks {row['rollbacks']}  left out "
            f"{row['left_out']}  ({row['wall_s']:.0f}s)",
            flush=True,
        )
    clean = results["clean"]["final_eval_loss"]
    for row in results.values():
        row["vs_clean"] = row["final_eval_loss"] / clean - 1
    limits = {"kill_all": 0.02, "kill_all_checkpointed": 0.02, "kill_all_s3": 0.02, "poisoned": 0.01}
    checks = {
        f"{name}_completes_within_{limit:.0%}_of_clean": {
            "value": results[name]["vs_clean"],
            "met": results[name]["rounds_committed"] == rounds and results[name]["vs_clean"] <= limit,
        }
        for name, limit in limits.items()
    }
    checks["killed_runs_rolled_back"] = {
        "value": [results[name]["rollbacks"] for name in limits if name.startswith("kill")],
        "met": all(len(results[name]["rollbacks"]) == 1 for name in limits if name.startswith("kill")),
    }
    checks["poison_left_out"] = {
        "value": results["poisoned"]["left_out"],
        "met": {"round": POISONED_ROUND, "ranks": [POISONED_RANK]} in results["poisoned"]["left_out"],
    }
    result = {
        "command": command,
        "replicas": n,
        "rounds": rounds,
        "sync_every": base.diloco.sync_every,
        "seed": seed,
        "kill_in_round": {
            "kill_all": KILL_IN,
            "kill_all_s3": KILL_IN,
            "kill_all_checkpointed": CHECKPOINTED_KILL_IN,
        },
        "checks": checks,
        "wall_s": round(time.monotonic() - started, 1),
        "runs": results,
    }
    (out / "results.json").write_text(json.dumps(result, indent=2))
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for results.json and the runs")
    parser.add_argument(
        "--config", default="deploy/configs/local-demo.toml", help="model, data, optimizers, H"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=8, help="outer rounds of every run (at least 8)")
    args = parser.parse_args(argv)
    if (args.out / "runs").is_dir() and any((args.out / "runs").iterdir()):
        parser.error(
            f"--out {args.out} already holds runs from an earlier invocation; choose a new directory"
        )
    if args.rounds < 8:
        parser.error(
            "--rounds must be at least 8: the kills land in rounds 4 and 6 and must leave rounds after"
        )
    try:
        args.base = load_config(args.config)
    except ConfigError as e:
        parser.error(str(e))
    if args.base.train.objective != "lm" or args.base.executor.type != "local":
        parser.error(f"{args.config}: needs train.objective 'lm' and executor.type 'local'")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    command = " ".join(
        ["python", "benchmarks/correlated_failures.py", *(sys.argv[1:] if argv is None else argv)]
    )
    result = run(args.base, args.rounds, args.seed, args.out, command)
    for name, check in result["checks"].items():
        print(f"{'met' if check['met'] else 'NOT met':8s} {name}: {check['value']}")
    print(f"wrote {args.out / 'results.json'} in {result['wall_s']:.0f}s")
    return 0 if all(c["met"] for c in result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
