"""A decoupled learner's own state, over real processes on the simulated accelerator: a learner killed
between publishes resumes its inner optimizer, schedule and data position, and a run whose processes all
stopped mid-way is resumed with ``launch --resume``. Asserted on what the store recorded (the versions'
records, the learners' saved states, the final global) and the logs' restored values, never on time."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from composer_serverless.rendezvous import checkpoint, layout
from composer_serverless.rendezvous import decoupled as versions
from composer_serverless.rendezvous.latest import newest_version
from tests.conftest import ran_on_the_simulated_accelerator, replicas_on_the_simulated_accelerator
from tests.rendezvous.harness import (
    create,
    logs_of,
    make_config,
    resume_in_a_process,
    start_replica,
    wait_all,
)
from tests.syncer.processes import killed_on, merges, run_decoupled

LEARNERS = 2
SETTINGS = {"replicas": LEARNERS, "embedding_average": "all", "mode": "decoupled"}
SYNC_EVERY = 4  # make_config's diloco.sync_every: inner steps per contribution


def final_global(run) -> dict[str, torch.Tensor]:
    return versions.load_params(run, versions.read_version(run, newest_version(run)), None)


def own_state(run, learner: int, seq: int) -> dict:
    """Learner ``learner``'s own state saved with its contribution ``seq``."""
    return checkpoint.read_snapshot(run, layout.replica_state(learner, seq))


@pytest.mark.slow
def test_a_learner_killed_between_publishes_resumes_its_own_state_and_changes_nothing(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Learner 1 SIGKILLed after publishing its contribution 1, as it reads version 2: restarted, it holds
    version 2 and restores the state it saved with contribution 1 (inner step 8, its data position, Adam's
    moments). With ``max_lag = 0`` and a full quorum that is exactly where it was, so the run ends on the
    uninterrupted run's final global bit for bit; a fresh inner optimizer would not."""
    store = str(tmp_path / "runs")
    logs = tmp_path / "logs"
    logs.mkdir()
    with replicas_on_the_simulated_accelerator():
        plain = create(make_config(store, "plain", tiny_model_dir, rounds=3, **SETTINGS))
        assert run_decoupled(plain, tmp_path / "plain-logs", LEARNERS) == [0] * (LEARNERS + 1)
        run = create(make_config(store, "killed", tiny_model_dir, rounds=3, **SETTINGS))
        others = [start_replica(run, r, logs / f"rank-{r}.log") for r in (0, LEARNERS)]
        dying = start_replica(run, 1, logs / "rank-1.log", faults=killed_on(layout.version(2)))
        assert wait_all([dying]) == [-signal.SIGKILL]
        # its contribution 1 is in, 2 is not (0 may be pruned already: versions 1 and 2 consumed it)
        listed = run.list(layout.contributions(1))
        assert "00000001" in listed and "00000002" not in listed
        restarted = start_replica(run, 1, logs / "rank-1-again.log")
        assert wait_all([*others, restarted]) == [0] * (LEARNERS + 1)
    assert ran_on_the_simulated_accelerator(logs)

    saved = own_state(run, 1, 1)
    assert saved["schedule"]["last_epoch"] == 2 * SYNC_EVERY
    said = (logs / "rank-1-again.log").read_text()
    assert (
        f"started from global version 2 and its own state of contribution 1: inner step {2 * SYNC_EVERY}, "
        f"data position {saved['objective']}" in said
    )
    # What it saved is what the uninterrupted learner held at the same point.
    assert saved["objective"] == own_state(plain, 1, 1)["objective"]
    moments = saved["inner_optimizer"]["state"]
    assert moments and all(
        torch.equal(moments[i]["exp_avg"], own_state(plain, 1, 1)["inner_optimizer"]["state"][i]["exp_avg"])
        for i in moments
    )
    resumed, expected = final_global(run), final_global(plain)
    assert [name for name in expected if not torch.equal(resumed[name], expected[name])] == []
    assert sorted(map(tuple, versions.read_version(run, 3).merged)) == [(0, 2), (1, 2)]


@pytest.mark.slow
def test_a_decoupled_run_stopped_mid_way_is_resumed_and_merges_every_contribution_once(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Every learner SIGKILLed as it publishes its contribution 2 (its own state of it already written),
    then the syncer: ``launch --resume --set diloco.rounds=4`` (one more than the run had) continues it.
    Each learner restores its state of contribution 1 (the newest whose contribution exists: the data of
    the lost one is trained again), its schedule placed at the version it starts from, the syncer its
    newest version; over the run every contribution of every
    learner is merged exactly once, in sequence, and the run ends at its new last version."""
    config = make_config(
        str(tmp_path / "runs"), "stopped", tiny_model_dir, rounds=3, decoupled={"max_lag": 1}, **SETTINGS
    )
    run = create(config)
    logs = tmp_path / "logs"
    logs.mkdir()
    with replicas_on_the_simulated_accelerator():
        syncer = start_replica(run, LEARNERS, logs / "syncer.log")
        learners = [
            start_replica(run, r, logs / f"rank-{r}.log", faults=killed_on(layout.contribution(r, 2)))
            for r in range(LEARNERS)
        ]
        assert wait_all(learners) == [-signal.SIGKILL] * LEARNERS
        syncer.kill()
        assert wait_all([syncer]) == [-signal.SIGKILL]
        stopped_at = newest_version(run)
        assert 1 <= stopped_at < 3
        for r in range(LEARNERS):  # the state of the contribution that was never written
            assert sorted(run.list(layout.replica_states(r))) == ["1", "2"]
        cli = resume_in_a_process(run, "diloco.rounds=4")
    resumed_logs = run.local_dir("logs")
    assert cli.returncode == 0, cli.stdout + cli.stderr + logs_of(resumed_logs)
    assert f"resuming run stopped from its global version {stopped_at}" in cli.stdout
    assert ran_on_the_simulated_accelerator(resumed_logs)
    said = logs_of(resumed_logs)
    # its schedule placed at the version it holds (it had trained two rounds, as its state says)
    assert said.count(f"its own state of contribution 1: inner step {stopped_at * SYNC_EVERY}") == LEARNERS

    records = merges(run)
    assert sorted(records) == list(range(5)) and all(r.parent == v - 1 for v, r in records.items())
    merged = [tuple(pair) for v in sorted(records) for pair in records[v].merged]
    assert len(merged) == len(set(merged)) and all(not r.dropped for r in records.values())
    for learner in range(LEARNERS):
        seqs = sorted(seq for who, seq in merged if who == learner)
        assert seqs == list(range(len(seqs))) and len(seqs) >= 4
        assert records[4].consumed[learner] == len(seqs)
    assert run.exists(layout.SUMMARY) and run.exists(f"{layout.FINAL}/config.json")
