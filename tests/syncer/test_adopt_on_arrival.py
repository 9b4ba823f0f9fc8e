"""Learners that adopt each newer global when their background reader has read it (``adopt_when =
"arrival"``), as real processes on the simulated accelerator: they adopt in the middle of their inner steps,
their rows say at which step and how many steps an overwrite discarded, their contributions count only the
steps they carry, and the run reaches its last version. Asserted on what the store recorded, never on time."""

from __future__ import annotations

from pathlib import Path

import pytest

from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.codec import read_header
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import read_heartbeats, read_metrics
from tests.conftest import ran_on_the_simulated_accelerator, replicas_on_the_simulated_accelerator
from tests.rendezvous.harness import create, make_config
from tests.syncer.processes import merges, run_decoupled

LEARNERS = 2
ROUNDS = 6
H = 8


@pytest.mark.slow
def test_learners_adopt_mid_round_and_count_only_the_steps_they_send(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A quorum of 1 of 2 and max_lag = 1: a version is merged whenever either learner publishes, so the
    other is in the middle of its round when it appears; with ``overwrite`` the steps before are dropped."""
    config = make_config(
        str(tmp_path / "runs"),
        "arrival",
        tiny_model_dir,
        replicas=LEARNERS,
        rounds=ROUNDS,
        sync_every=H,
        mode="decoupled",
        embedding_average="all",
        decoupled={
            "min_quorum": 1,
            "grace_s": 0.0,
            "max_lag": 1,
            "adopt": "overwrite",
            "adopt_when": "arrival",
            "poll_s": 0.01,
            "keep_versions": None,  # every contribution kept: the test reads their headers
        },
    )
    run = create(config)
    logs = tmp_path / "logs"
    with replicas_on_the_simulated_accelerator():
        assert run_decoupled(run, logs, LEARNERS) == [0] * (LEARNERS + 1)
    assert ran_on_the_simulated_accelerator(logs)
    assert [read_heartbeats(run)[r]["state"] for r in range(LEARNERS)] == ["done"] * LEARNERS

    records = merges(run)
    assert sorted(records) == list(range(ROUNDS + 1))
    merged = [tuple(pair) for v in sorted(records) for pair in records[v].merged]
    assert len(merged) == len(set(merged))  # nothing merged twice

    rows = [row for rank, ranks_rows in read_metrics(run).items() if rank < LEARNERS for row in ranks_rows]
    mid_round = [row for row in rows if row.get("adopted_at_step", 0) > 0]
    assert mid_round, "no learner adopted a version in the middle of its inner steps"
    for row in mid_round:  # overwrite: the steps of the round before the adoption, less those dropped already
        # (a round runs H steps from the merge of the learner's previous contribution: fewer than 2 H)
        assert 0 < row["overwritten_steps"] <= row["adopted_at_step"] < 2 * H
    for rank in range(LEARNERS):
        for row in read_metrics(run)[rank]:
            if "contribution" not in row:
                continue
            header = contribution_header(run, rank, row["contribution"])
            dropped = row["discarded_steps"]
            assert header["steps"] == row["steps"] - dropped > 0
            assert header["tokens"] == sum(s["tokens"] for s in row["step_rows"][dropped:])
            assert header["base"] == row["base_version"]
            # the time of the steps it carries, which the syncer's grace window reads
            assert header["seconds"] == sum(s["time_s"]["step"] for s in row["step_rows"][dropped:]) > 0


def contribution_header(run: ObjectStore, learner: int, seq: int) -> dict[str, float]:
    """A contribution's header (its safetensors metadata), no tensor decoded."""
    meta = read_header(run.get(layout.contribution(learner, seq)))[0]["__metadata__"]
    assert isinstance(meta, dict)
    return {
        **{field: int(meta[field]) for field in ("base", "tokens", "steps")},
        "seconds": float(meta["seconds"]),
    }
