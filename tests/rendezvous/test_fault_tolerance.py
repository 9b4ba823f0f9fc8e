"""Replica processes under faults injected by rule: kill -9 mid-round, and a store failing a fraction of
its calls transiently. Multi-process, over file:// and a real S3 server."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from harness import (
    PROCESS_TIMEOUT_S,
    REFERENCE_SETTINGS,
    ReferenceRun,
    create,
    digests,
    logs_of,
    make_config,
    rows,
    run_replicas,
    start_replica,
    wait_all,
)
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from composer_serverless.config import RunConfig
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.codec import encode
from composer_serverless.rendezvous.latest import latest_round
from composer_serverless.rendezvous.rows import span_rows, spans
from composer_serverless.rendezvous.sharding import shard_bounds
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import read_heartbeats
from composer_serverless.replicas.diloco import split_fragments
from composer_serverless.replicas.node import SOLO
from composer_serverless.replicas.touches import Touches


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + PROCESS_TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _three_replicas_one_killed(
    tmp_path: Path, model_dir: Path, run_id: str, *, victim: int, kill_on: str, held_at: int, **settings: Any
) -> tuple[RunConfig, ObjectStore, list[subprocess.Popen[bytes]]]:
    """Three replicas (quorum of 2, a short straggler wait); ``victim`` SIGKILLs itself at its first store call
    on a key matching ``kill_on``, the others are held before round ``held_at`` until ``tmp_path/release``
    exists. Logs in ``tmp_path/logs``."""
    config = make_config(
        f"file://{tmp_path}/runs",
        run_id,
        model_dir,
        replicas=3,
        min_replicas=2,
        quorum_grace_min_s=2.0,
        quorum_grace_max_s=30.0,
        **settings,
    )
    run = create(config)
    logs = tmp_path / "logs"
    logs.mkdir()
    hold = json.dumps({"hold": {f"rounds/{held_at}/": str(tmp_path / "release")}})
    kill = json.dumps({"kill_on": kill_on})
    procs = [start_replica(run, r, logs / f"rank-{r}.log", kill if r == victim else hold) for r in range(3)]
    return config, run, procs


def _restart_then_release(
    run: ObjectStore, tmp_path: Path, procs: list[subprocess.Popen[bytes]], victim: int
) -> None:
    """Start ``victim`` again, let the held replicas go once it has loaded the latest state, and see all three
    to a clean end."""
    log = tmp_path / "logs" / f"rank-{victim}.log"
    procs[victim] = start_replica(run, victim, log)
    wait_until(lambda: "resumed from round" in log.read_text(), f"replica {victim} to load the latest state")
    (tmp_path / "release").touch()
    assert wait_all(procs) == [0, 0, 0], logs_of(tmp_path / "logs")


def _rejoined(run: ObjectStore, victim: int, killed_in: int, held_at: int, rounds: int) -> None:
    """The round of the kill committed with the two others, the restarted replica contributed again once it
    was back, and every replica that reports a round reports the same global parameters, to the bit."""
    by_rank = rows(run)
    others = [r for r in range(3) if r != victim]
    assert [by_rank[r][killed_in]["participants"] for r in others] == [others, others]
    assert by_rank[0][held_at]["participants"] == [0, 1, 2]
    per_round = digests(run)
    assert all(len(d) == 1 for d in per_round.values()), per_round
    assert {by_rank[r][rounds]["global_sha256"] for r in range(3)} == per_round[rounds]
    assert latest_round(run) == rounds


def _ranks_of(worker: subprocess.Popen[bytes]) -> list[psutil.Process]:
    """The rank processes a replica's worker started (not multiprocessing's helpers)."""
    children = psutil.Process(worker.pid).children()
    return [c for c in children if "spawn_main" in " ".join(c.cmdline())]


def _gone(processes: list[psutil.Process]) -> bool:
    return not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in processes)


@pytest.mark.slow
def test_kill_9_mid_round_commits_without_the_replica_which_then_rejoins(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Replica 2 is killed when it starts uploading in round 3. The other two commit round 3 (and 4) without
    it and are then held before round 5 until the restarted replica has loaded the latest state, so that
    its rejoining is an ordering of events, not a race against the survivors. With the sparse codec: the
    dead replica's residual is gone, and the restarted one starts from zeros (its own state is of round 2)."""
    rounds, killed_in, held_at = 6, 3, 5
    _, run, procs = _three_replicas_one_killed(
        tmp_path,
        tiny_model_dir,
        "kill",
        victim=2,
        kill_on=f"rounds/{killed_in}/0/0/in/2-",
        held_at=held_at,
        rounds=rounds,
        checkpoint_every=1,
        codec="sparse",
    )
    wait_until(lambda: procs[2].poll() is not None, "replica 2 to die")
    assert procs[2].returncode == -signal.SIGKILL
    wait_until(lambda: run.exists(layout.metrics(0, killed_in)), f"round {killed_in} to commit")
    _restart_then_release(run, tmp_path, procs, 2)
    _rejoined(run, 2, killed_in, held_at, rounds)
    assert "(own state of round 2)" in (tmp_path / "logs" / "rank-2.log").read_text()


@pytest.mark.slow
def test_kill_9_of_one_rank_restarts_its_replica_whole(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Replicas of 2 FSDP ranks. Local rank 1 of replica 1 is killed as it uploads its shard in round 3: its
    sibling is stopped and the replica's worker exits with an error naming the kill; the two others commit
    round 3 without it. Restarted, the replica rejoins whole, and every round's global parameters are the same
    on every replica that reports it."""
    rounds, killed_in, held_at = 5, 3, 5
    _, run, procs = _three_replicas_one_killed(
        tmp_path,
        tiny_model_dir,
        "rank-kill",
        victim=1,
        kill_on=f"rounds/{killed_in}/0/1/in/1-",
        held_at=held_at,
        ranks=2,
        rounds=rounds,
        checkpoint_every=1,
    )
    wait_until(lambda: len(_ranks_of(procs[1])) == 2, "replica 1 to start its 2 ranks")
    ranks = _ranks_of(procs[1])
    wait_until(lambda: procs[1].poll() is not None, "replica 1 to stop")
    assert procs[1].returncode == 1
    assert _gone(ranks)
    beat = read_heartbeats(run)[1]
    assert beat["state"] == "failed" and "local rank 1" in beat["error"] and "SIGKILL" in beat["error"]
    wait_until(lambda: run.exists(layout.metrics(0, killed_in)), f"round {killed_in} to commit")
    _restart_then_release(run, tmp_path, procs, 1)
    _rejoined(run, 1, killed_in, held_at, rounds)


@pytest.mark.slow
def test_the_ranks_of_a_killed_worker_stop_too(tmp_path: Path, tiny_model_dir: Path) -> None:
    """kill -9 of a replica's worker leaves no one to stop its ranks: they notice it and exit, and nothing of
    the replica is left running."""
    run = create(make_config(f"file://{tmp_path}/runs", "orphans", tiny_model_dir, ranks=2, rounds=50))
    worker = start_replica(run, 0, tmp_path / "rank-0.log")
    wait_until(lambda: len(_ranks_of(worker)) == 2, "the worker to start its 2 ranks")
    ranks = _ranks_of(worker)
    worker.kill()
    worker.wait()
    wait_until(lambda: _gone(ranks), "the orphaned ranks to exit")


@pytest.mark.slow
def test_a_late_replica_heals_then_realigns_with_the_next_round(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Replica 1's upload of round 2 is held until replica 0 has committed round 2 alone, so it arrives after
    the quorum: it takes the round's average from the store (its parameters stay identical), then, its lag
    being one that would persist, waits for round 3 to be published and continues from it in step."""
    config = make_config(f"file://{tmp_path}/runs", "late", tiny_model_dir, rounds=5, min_replicas=1)
    run = create(config)
    logs = tmp_path / "logs"
    logs.mkdir()
    gate = tmp_path / "release"
    hold = json.dumps({"hold": {"rounds/2/0/0/in/1-": str(gate)}})
    procs = [start_replica(run, 0, logs / "rank-0.log"), start_replica(run, 1, logs / "rank-1.log", hold)]
    wait_until(lambda: run.exists(layout.metrics(0, 2)), "replica 0 to commit round 2")
    gate.touch()
    assert wait_all(procs) == [0, 0], logs_of(logs)

    by_rank = rows(run)
    assert by_rank[0][2]["participants"] == [0] == by_rank[1][2]["participants"]
    # It skipped round 3 and continued from its published state.
    assert by_rank[1][3]["caught_up_from"] == 2 and "train_loss" not in by_rank[1][3]
    per_round = digests(run)
    assert all(len(d) == 1 for d in per_round.values()), per_round
    assert set(per_round) == set(range(1, 6))


@pytest.mark.slow
def test_transient_store_faults_change_nothing(
    tmp_path: Path, tiny_model_dir: Path, s3_url: str, reference_run: ReferenceRun
) -> None:
    """The reference run repeated on S3 with a quarter of first attempts failing (and a quarter of the other
    writes failing after reaching the store, as a lost response) ends bit-identical to the clean run."""
    faulty = create(make_config(s3_url, "faulty", tiny_model_dir, **REFERENCE_SETTINGS))
    faults = {r: json.dumps({"fraction": 0.25, "lost_fraction": 0.25, "seed": r}) for r in range(2)}
    assert run_replicas(faulty, tmp_path / "logs", 2, faults) == [0, 0], logs_of(tmp_path / "logs")

    faulty_logs = logs_of(tmp_path / "logs")
    assert faulty_logs.count("InjectedFault") >= 20
    assert "reported 'exists' but the object is ours" in faulty_logs
    assert "FAILED" not in faulty_logs
    under_faults = digests(faulty)
    assert set(under_faults) == {1, 2, 3, 4, 5}
    assert under_faults == reference_run.digests


@pytest.mark.slow
def test_a_restarted_replica_asks_for_the_state_it_needs_between_checkpoints(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """No checkpoint yet when replica 2 is killed in round 3 and restarted: it finds the run rounds ahead,
    asks for the round in progress to be published (a heal request), loads it and rejoins in step. The
    survivors are held before round 5 until its request is there, so that this is an order of events."""
    rounds, killed_in, held_at = 6, 3, 5
    config, run, procs = _three_replicas_one_killed(
        tmp_path,
        tiny_model_dir,
        "heal",
        victim=2,
        kill_on=f"rounds/{killed_in}/0/0/in/2-",
        held_at=held_at,
        rounds=rounds,
    )
    assert config.diloco.checkpoint_every > rounds - 1  # only the last round is a checkpoint
    logs = tmp_path / "logs"
    release = tmp_path / "release"
    wait_until(lambda: procs[2].poll() is not None, "replica 2 to die")
    wait_until(lambda: run.exists(layout.metrics(0, killed_in)), f"round {killed_in} to commit")
    assert latest_round(run) == 0  # nothing published: no checkpoint, nobody asked
    restarted = start_replica(run, 2, logs / "rank-2.log")
    wait_until(lambda: run.exists(layout.heal_request(2)), "replica 2 to ask for the state it needs")
    release.touch()
    assert wait_all([procs[0], procs[1], restarted]) == [0, 0, 0], logs_of(logs)

    by_rank = rows(run)
    caught_up = [k for k, row in by_rank[2].items() if "caught_up_from" in row]
    assert caught_up and 2 in by_rank[0][rounds]["participants"], by_rank[2]
    per_round = digests(run)
    assert all(len(d) == 1 for d in per_round.values()), per_round
    assert latest_round(run) == rounds and not run.list(layout.HEAL)


@pytest.mark.slow
def test_hostile_objects_in_the_store_are_rejected_and_the_run_finishes(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Written into the run before the replicas get there, as anyone with access to the bucket could: a
    garbage quorum record for round 2, an input of replica 1 a MiB larger than any shard (round 2), and one
    of the right size whose own valid checksum covers a NaN (round 3). Each is rejected with a log line; the
    run finishes, every replica's global parameters identical and finite."""
    run = create(make_config(f"file://{tmp_path}/runs", "hostile", tiny_model_dir, rounds=4))
    run.put(layout.quorum(2, 0), b"\x00\xff garbage")
    run.put(f"{layout.sync(2, 0)}/{layout.sync_input(1, 0)}", bytes(2**20 + 10))
    # One fragment holding every parameter: replica 1's shard 0 is the first half of their flat vector.
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    params = sum(p.numel() for p in model.parameters())
    start, end = shard_bounds(params, 2)[0]
    identity = {"run_id": "hostile", "round": "3", "fragment": "0", "local": "0", "rank": "1", "shard": "0"}
    poisoned = torch.zeros(end - start)
    poisoned[::1000] = float("nan")
    # With the row bits a shard holding embedding rows carries (a bit per row and step bucket), so that it is
    # the NaN that rejects it, not its layout.
    touches = Touches(model, split_fragments(model, 1), SOLO, window=4)
    bits = torch.zeros(span_rows(spans(touches.blocks[0], start, end)) * touches.buckets, dtype=torch.bool)
    run.put(f"{layout.sync(3, 0)}/{layout.sync_input(1, 0)}", encode(poisoned, identity, "fp32", rows=bits))
    assert run_replicas(run, tmp_path / "logs", 2) == [0, 0], logs_of(tmp_path / "logs")
    logs = logs_of(tmp_path / "logs")
    assert "quorum.json is malformed" in logs
    assert "more than the" in logs and "non-finite values" in logs  # each rejected for what it is
    by_rank = rows(run)
    for round_index in (2, 3):  # replica 1's input was left out: the round averaged replica 0 alone
        assert by_rank[0][round_index]["participants"] == [0] and by_rank[0][round_index]["rejected"] == [1]
    assert by_rank[0][4]["participants"] == [0, 1] and "rejected" not in by_rank[0][4]
    per_round = digests(run)
    assert set(per_round) == {1, 2, 3, 4} and all(len(d) == 1 for d in per_round.values()), per_round
    final = load_file(run.local_dir(layout.FINAL) / "model.safetensors")
    assert all(bool(torch.isfinite(t).all()) for t in final.values())


@pytest.mark.slow
def test_a_store_outage_mid_run_costs_only_its_length(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Every write of both replicas fails as on a full disk for 5 s, from the moment round 2 is recorded:
    heartbeats, uploads and quorum wait it out, and the run finishes with every round averaged over both
    replicas, bit-identical, and no temporary file left. (How soon the round after an outage commits, against
    a normal round, is measured by benchmarks/store_outage.py.)"""
    run = create(make_config(f"file://{tmp_path}/runs", "outage", tiny_model_dir, rounds=5, min_replicas=2))
    start, end = tmp_path / "outage-start", tmp_path / "outage-end"
    faults = json.dumps({"outage": [str(start), str(end)]})
    logs = tmp_path / "logs"
    logs.mkdir()
    procs = [start_replica(run, r, logs / f"rank-{r}.log", faults) for r in range(2)]
    wait_until(lambda: run.exists(layout.metrics(0, 2)), "round 2 to be recorded")
    start.touch()
    time.sleep(5)
    end.touch()
    assert wait_all(procs) == [0, 0], logs_of(logs)
    assert "refused (OSError" in logs_of(logs)
    by_rank = rows(run)
    assert all(by_rank[r][k]["participants"] == [0, 1] for r in range(2) for k in range(1, 6)), by_rank
    per_round = digests(run)
    assert set(per_round) == set(range(1, 6)) and all(len(d) == 1 for d in per_round.values()), per_round
    assert not [p for p in (tmp_path / "runs").rglob("*") if ".tmp-" in p.name]


@pytest.mark.slow
def test_a_publisher_that_dies_while_publishing_loses_no_evaluation(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Replica 0 publishes round 3 and is killed as it writes the state's manifest: its metrics row of round
    3, with the round's held-out loss, is already in the store."""
    rounds = 5
    run = create(
        make_config(
            f"file://{tmp_path}/runs",
            "publisher",
            tiny_model_dir,
            rounds=rounds,
            min_replicas=1,
            quorum_grace_min_s=0.5,
            quorum_grace_max_s=5.0,
            checkpoint_every=1,
        )
    )
    logs = tmp_path / "logs"
    logs.mkdir()
    kill = json.dumps({"kill_on": r"state/3/0/manifest\.json"})
    procs = [start_replica(run, 0, logs / "rank-0.log", kill), start_replica(run, 1, logs / "rank-1.log")]
    wait_until(lambda: procs[0].poll() is not None, "replica 0 to die publishing round 3")
    assert procs[0].returncode == -signal.SIGKILL
    assert "eval" in rows(run)[0][3]  # written before the publishing it died in
    restarted = start_replica(run, 0, logs / "rank-0.log")
    assert wait_all([restarted, procs[1]]) == [0, 0], logs_of(logs)
    assert latest_round(run) == rounds
