"""Decoupled mode under kill -9, over real processes: the syncer killed mid-merge, a learner killed, every
learner killed at once. Asserted on what the store recorded (the versions' records, the learners' rows),
never on time."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from composer_serverless.rendezvous import decoupled as versions
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.latest import newest_version
from tests.rendezvous.harness import create, make_config, start_replica, wait_all
from tests.syncer.processes import killed_on, merges, pruned_to, snapshots_and_contributions

LEARNERS = 3
ROUNDS = 3
SETTINGS = {"replicas": LEARNERS, "rounds": ROUNDS, "embedding_average": "all", "mode": "decoupled"}


def every_merge_once(records) -> list[tuple[int, int]]:
    """Every (learner, seq) merged over the run's versions, in version order, duplicates kept."""
    return [tuple(pair) for v in sorted(records) for pair in records[v].merged]


@pytest.mark.slow
def test_a_syncer_killed_mid_merge_restarts_and_merges_each_contribution_once(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Killed after writing version 2's snapshots and before creating its record: version 2 does not exist,
    its orphaned snapshots count for nothing; the restarted syncer continues from version 1's record, and
    over the run every contribution is merged exactly once and no version is skipped."""
    run = create(make_config(str(tmp_path / "runs"), "killed-syncer", tiny_model_dir, **SETTINGS))
    logs = tmp_path / "logs"
    logs.mkdir()
    learners = [start_replica(run, r, logs / f"rank-{r}.log") for r in range(LEARNERS)]
    dying = start_replica(run, LEARNERS, logs / "syncer-1.log", faults=killed_on(layout.version(2)))
    assert wait_all([dying]) == [-signal.SIGKILL]
    assert not run.exists(layout.version(2)) and run.exists(layout.version(1))
    orphans = [name for name in run.list(layout.GLOBALS) if name.startswith("00000002-")]
    assert len(orphans) == 1  # its write of version 2 reached the store; nothing names it
    restarted = start_replica(run, LEARNERS, logs / "syncer-2.log")
    assert wait_all([*learners, restarted]) == [0] * (LEARNERS + 1)

    records = merges(run)
    assert sorted(records) == list(range(ROUNDS + 1))
    merged = every_merge_once(records)
    assert sorted(merged) == [(learner, seq) for learner in range(LEARNERS) for seq in range(ROUNDS)]
    assert records[2].writer != records[1].writer  # version 2 is the restarted syncer's
    assert not any(name.startswith(f"00000002-{records[2].writer}") for name in orphans)
    # Pruned to the newest two versions (the default keep_versions): the orphans went with the rest.
    assert snapshots_and_contributions(run) == pruned_to(records, 2)


@pytest.mark.slow
def test_a_syncer_killed_while_pruning_leaves_nothing_behind_once_restarted(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Killed in its pruning, deleting a snapshot of version 0 (its manifest gone, its files not): in version
    2's pruning, or earlier when learners that raced to write version 0 left orphan snapshots of it (pruned
    at the syncer's start or after version 1, as the race and the learners' speed fall). The restarted syncer
    prunes first, merges the next version from the newest committed one, and the run ends holding only what
    keep_versions says."""
    run = create(make_config(str(tmp_path / "runs"), "killed-pruning", tiny_model_dir, **SETTINGS))
    logs = tmp_path / "logs"
    logs.mkdir()
    learners = [start_replica(run, r, logs / f"rank-{r}.log") for r in range(LEARNERS)]
    half_deleted = f"{layout.GLOBALS}/00000000-[0-9a-f]+"  # the snapshot's prefix, after its manifest
    dying = start_replica(run, LEARNERS, logs / "syncer-1.log", faults=killed_on(half_deleted))
    assert wait_all([dying]) == [-signal.SIGKILL]
    killed_at = newest_version(run)  # the version whose pruning (or the start's) the kill cut short
    assert 0 <= killed_at <= 2 and not run.exists(layout.version(killed_at + 1))
    # The first listed snapshot of version 0 was being deleted.
    version0 = [name for name in run.list(layout.GLOBALS) if name.startswith("00000000-")][0]
    assert run.list(f"{layout.GLOBALS}/{version0}") == [layout.SNAPSHOT_STATE, layout.SNAPSHOT_TENSORS]
    restarted = start_replica(run, LEARNERS, logs / "syncer-2.log")
    assert wait_all([*learners, restarted]) == [0] * (LEARNERS + 1)

    records = merges(run)
    assert sorted(records) == list(range(ROUNDS + 1))
    assert sorted(every_merge_once(records)) == [(r, s) for r in range(LEARNERS) for s in range(ROUNDS)]
    # the version after the kill is the restarted syncer's
    assert records[killed_at + 1].writer != records[killed_at].writer
    assert snapshots_and_contributions(run) == pruned_to(records, 2)


@pytest.mark.slow
def test_a_killed_learner_never_holds_the_others_up(tmp_path: Path, tiny_model_dir: Path) -> None:
    """With a quorum of 2 of 3, learner 2 killed at its first contribution and never restarted: the syncer
    goes on merging learners 0 and 1, and they reach the last version without it."""
    config = make_config(
        str(tmp_path / "runs"),
        "killed-learner",
        tiny_model_dir,
        **SETTINGS,
        decoupled={"min_quorum": 2, "grace_s": 0.0},
    )
    run = create(config)
    logs = tmp_path / "logs"
    logs.mkdir()
    dead = start_replica(run, 2, logs / "rank-2.log", faults=killed_on(layout.contribution(2, 0)))
    assert wait_all([dead]) == [-signal.SIGKILL]
    others = [start_replica(run, r, logs / f"rank-{r}.log") for r in (0, 1, LEARNERS)]
    assert wait_all(others) == [0, 0, 0]

    records = merges(run)
    assert sorted(records) == list(range(ROUNDS + 1))
    assert {learner for learner, _ in every_merge_once(records)} == {0, 1}
    for rank in (0, 1):
        row = json.loads(run.get(layout.metrics(rank, ROUNDS)))
        assert row["version"] == ROUNDS and row["contributions"] == [ROUNDS - 1]


@pytest.mark.slow
def test_every_learner_killed_at_once_the_run_goes_on_from_its_last_global(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Every learner SIGKILLed as it publishes its second contribution (version 1 merged): restarted, each
    starts from version 1 (the newest merged) and the run reaches its last version, merging every learner's
    work from there."""
    run = create(make_config(str(tmp_path / "runs"), "killed-all", tiny_model_dir, **SETTINGS))
    logs = tmp_path / "logs"
    logs.mkdir()
    syncer = start_replica(run, LEARNERS, logs / "syncer.log")
    first = [
        start_replica(run, r, logs / f"rank-{r}.log", faults=killed_on(layout.contribution(r, 1)))
        for r in range(LEARNERS)
    ]
    assert wait_all(first) == [-signal.SIGKILL] * LEARNERS
    assert merges(run)[1].consumed == dict.fromkeys(range(LEARNERS), 1)
    again = [start_replica(run, r, logs / f"rank-{r}-again.log") for r in range(LEARNERS)]
    assert wait_all([*again, syncer]) == [0] * (LEARNERS + 1)

    records = merges(run)
    assert sorted(records) == list(range(ROUNDS + 1))
    for rank in range(LEARNERS):
        assert "started from global version 1" in (logs / f"rank-{rank}-again.log").read_text()
    # Each learner's contributions 1 and 2 were written by the restarted learners, from version 1 and 2.
    assert sorted(every_merge_once(records)) == [(r, s) for r in range(LEARNERS) for s in range(ROUNDS)]


@pytest.mark.slow
def test_syncer_shards_killed_mid_merge_restart_and_merge_each_contribution_once(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A syncer of two shards. Shard 1 killed while writing its fragment of version 2 (its parameters
    written, its outer state half): restarted, it merges that fragment again under its new name. Shard 0
    killed once both parts of version 2 exist, before creating the version's record: restarted, it takes
    up the plan and the parts as they are (merging nothing again) and creates the record. Over the run
    every contribution is merged exactly once, and the killed shard's orphaned fragment is pruned."""
    settings = {**SETTINGS, "decoupled": {"syncer_shards": 2}}
    run = create(make_config(str(tmp_path / "runs"), "killed-shards", tiny_model_dir, **settings))
    logs = tmp_path / "logs"
    logs.mkdir()
    learners = [start_replica(run, r, logs / f"rank-{r}.log") for r in range(LEARNERS)]
    half_written = f"{layout.SYNCER_STATES}/00000002-[0-9a-f]+/{layout.SNAPSHOT_MANIFEST}"
    shard1 = start_replica(run, LEARNERS + 1, logs / "shard-1.log", faults=killed_on(half_written))
    shard0 = start_replica(run, LEARNERS, logs / "shard-0.log", faults=killed_on(layout.version(2)))
    assert wait_all([shard1]) == [-signal.SIGKILL]
    assert run.exists(layout.version_plan(2)) and not run.exists(layout.version_part(2, 1))
    orphans = [name for name in run.list(layout.GLOBALS) if name.startswith("00000002-")]
    shard1 = start_replica(run, LEARNERS + 1, logs / "shard-1-again.log")
    assert wait_all([shard0]) == [-signal.SIGKILL]
    assert not run.exists(layout.version(2))
    parts = [versions.read_part(run, 2, fragment) for fragment in (0, 1)]
    assert all(part is not None for part in parts)
    shard0 = start_replica(run, LEARNERS, logs / "shard-0-again.log")
    assert wait_all([*learners, shard0, shard1]) == [0] * (LEARNERS + 2)

    records = merges(run)
    assert sorted(records) == list(range(ROUNDS + 1))
    assert sorted(every_merge_once(records)) == [(r, s) for r in range(LEARNERS) for s in range(ROUNDS)]
    # version 2 is made of the parts that existed at shard 0's kill, the restarted shard 1's among them
    assert records[2].parts == [part.writer for part in parts if part is not None]
    assert all(f"00000002-{records[2].parts[1]}" != name for name in orphans)
    # pruned to the newest two versions: each of their fragments' snapshots, no orphan
    kept = sorted(f"{v:08d}-{w}" for v in (ROUNDS - 1, ROUNDS) for w in records[v].writers)
    assert run.list(layout.GLOBALS) == kept and run.list(layout.SYNCER_STATES) == kept
