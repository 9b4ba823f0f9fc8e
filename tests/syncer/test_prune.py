"""What the syncer deletes after a commit (``syncer/prune.py``): the store holds exactly the newest
``keep_versions`` versions' snapshots, every record, and the contributions the oldest kept version had not
consumed; a reader whose
version went meanwhile takes the newest. On the local store and on a real S3 server (moto)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from composer_serverless.rendezvous import checkpoint, layout
from composer_serverless.rendezvous import decoupled as versions
from composer_serverless.syncer.prune import consumed_contributions, stale_snapshots
from tests.syncer.test_syncer import run_of, send

SNAPSHOT = sorted((layout.SNAPSHOT_MANIFEST, layout.SNAPSHOT_STATE, layout.SNAPSHOT_TENSORS))


def snapshot_files(prefix: str) -> list[str]:
    return [f"{prefix}/{name}" for name in SNAPSHOT]


def test_stale_snapshots_are_those_before_the_kept_versions_and_those_no_record_names() -> None:
    names = ["00000001-a", "00000002-a", "00000003-a", "00000003-b", "00000004-c", "00000004-a", "junk"]
    writers = {1: ["a"], 2: ["a"], 3: ["a"], 4: ["a"]}
    assert stale_snapshots(names, 3, writers.__getitem__, keep=2) == ["00000001-a", "00000003-b"]
    # keep 1: only the newest's own; version 4's snapshots may be a merge in progress
    assert stale_snapshots(names, 3, writers.__getitem__, keep=1) == [
        "00000001-a",
        "00000002-a",
        "00000003-b",
    ]
    assert stale_snapshots(names, 4, writers.__getitem__, keep=1) == [
        "00000001-a",
        "00000002-a",
        "00000003-a",
        "00000003-b",
        "00000004-c",
    ]
    # a sharded syncer's version names a writer per fragment: each one's snapshot stays
    assert stale_snapshots(names, 4, {4: ["c", "a"]}.__getitem__, keep=1) == [
        "00000001-a",
        "00000002-a",
        "00000003-a",
        "00000003-b",
    ]
    assert consumed_contributions(["00000000", "00000001", "00000002", "x"], 2) == ["00000000", "00000001"]
    # a sharded syncer's contributions: each one's fragments go with it, those of a later one stay
    fragments = ["00000001", "00000001-0a1b2c3d4e5f-0", "00000001-0a1b2c3d4e5f-1", "00000002-ffffffffffff-0"]
    assert consumed_contributions(fragments, 2) == fragments[:3]


@pytest.fixture(params=["local", "s3"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return request.getfixturevalue("s3_url") if request.param == "s3" else str(tmp_path / "store")


def test_after_three_merges_the_store_holds_exactly_what_is_still_needed(
    tmp_path: Path, store_url: str
) -> None:
    run, syncer = run_of(tmp_path, store_url, min_quorum=2, grace_s=0.0, keep_versions=2)
    syncer._load(0)
    for seq in range(2):
        for learner in range(3):
            send(run, learner, seq, [1.0, 1.0, 1.0], base=seq)
        syncer._merge(syncer._gather())
    # Left by other syncers: one that lost version 3 (or was killed before its record) and one writing 4.
    orphan = {"w": torch.zeros(2), "b": torch.zeros(1)}
    checkpoint.write_snapshot(run, layout.global_params(3, "loser"), orphan)
    checkpoint.write_snapshot(run, layout.global_params(4, "next"), orphan)
    send(run, 0, 2, [1.0, 1.0, 1.0], base=2)
    send(run, 1, 2, [1.0, 1.0, 1.0], base=2)
    syncer._merge(syncer._gather())  # a quorum of 2: learner 2's third contribution is not in it
    send(run, 2, 2, [1.0, 1.0, 1.0], base=2)  # late: the next version's to take

    w = syncer.writer
    expected = sorted(
        [layout.version(v) for v in range(4)]
        + snapshot_files(layout.global_params(2, w))
        + snapshot_files(layout.global_params(3, w))
        + snapshot_files(layout.global_params(4, "next"))
        + snapshot_files(layout.syncer_state(2, w))
        + snapshot_files(layout.syncer_state(3, w))
        # version 2 (kept) had not consumed the third contributions: a rollback to it would merge them again
        + [layout.contribution(0, 2), layout.contribution(1, 2), layout.contribution(2, 2)]
    )
    held = sorted(f"{layout.DECOUPLED}/{key}" for key in run.list_tree(layout.DECOUPLED))
    assert held == expected
    assert versions.read_version(run, 3).consumed == {0: 3, 1: 3, 2: 2}
    # Pruning again (a restarted syncer's first act) finds nothing more to delete.
    syncer._prune()
    assert sorted(f"{layout.DECOUPLED}/{key}" for key in run.list_tree(layout.DECOUPLED)) == expected
    # The late contribution is merged by the next version; what version 3 (now the oldest kept) consumed
    # goes with version 2, what it had not stays.
    send(run, 0, 3, [1.0, 1.0, 1.0], base=3)
    syncer._merge(syncer._gather())
    assert versions.read_version(run, 4).merged == [[0, 3], [2, 2]]
    assert run.list_tree(layout.CONTRIBUTIONS) == ["0/00000003", "2/00000002"]
    assert run.list(layout.GLOBALS) == [f"00000003-{w}", f"00000004-{w}"]


def test_a_reader_of_a_pruned_version_takes_the_newest(tmp_path: Path) -> None:
    run, syncer = run_of(tmp_path, keep_versions=1)
    syncer._load(0)
    for seq in range(2):
        for learner in range(3):
            send(run, learner, seq, [float(seq + 1)] * 3, base=seq)
        syncer._merge(syncer._gather())
    listed = versions.read_version(run, 1)  # as a learner that listed version 1 just before version 2
    record, params = versions.read_or_newer(run, listed, lambda r: versions.load_params(run, r, None))
    assert record.version == 2
    assert torch.equal(params["w"], syncer.params["w"]) and torch.equal(params["b"], syncer.params["b"])
    # A restarted syncer asked for version 1 continues from version 2, with its outer state.
    restarted = type(syncer)(run, syncer.config, None, syncer.reporter)
    restarted._load(1)
    assert restarted.record == versions.read_version(run, 2)
    momentum = [restarted.outer.state[p]["momentum_buffer"] for p in restarted.params.values()]
    assert [m.tolist() for m in momentum] == [
        m.tolist() for m in (syncer.outer.state[p]["momentum_buffer"] for p in syncer.params.values())
    ]
    # The newest itself damaged: no newer one to take, the error says so.
    run.delete(layout.snapshot_file(layout.global_params(2, syncer.writer), layout.SNAPSHOT_TENSORS))
    with pytest.raises(checkpoint.CheckpointError, match="listed in the manifest but missing"):
        versions.read_or_newer(run, record, lambda r: versions.load_params(run, r, None))


def test_unset_keep_versions_deletes_nothing(tmp_path: Path) -> None:
    run, syncer = run_of(tmp_path, keep_versions=None)
    syncer._load(0)
    for seq in range(3):
        for learner in range(3):
            send(run, learner, seq, [1.0, 1.0, 1.0], base=seq)
        syncer._merge(syncer._gather())
    assert run.list(layout.GLOBALS) == ["00000000-initial"] + [
        f"0000000{v}-{syncer.writer}" for v in (1, 2, 3)
    ]
    assert [run.list(layout.contributions(learner)) for learner in range(3)] == [
        ["00000000", "00000001", "00000002"]
    ] * 3
