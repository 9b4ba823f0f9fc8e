"""A syncer sharded by fragment, in this process on hand-made contributions: F shards merge what one syncer
merges, bit for bit; the outlier rule leaves out the same contributions in every shard; a fragment that fails
its checks is dropped by its shard alone; a shard restarted mid-merge takes up the plan and its part; a
learner's dead attempt at a contribution never mixes with its redo."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from composer_serverless.config import RunConfig
from composer_serverless.rendezvous import decoupled as versions
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.codec import PayloadError, encode
from composer_serverless.rendezvous.decoupled import Contribution, Version
from composer_serverless.rendezvous.runkey import RunKey
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import Reporter
from composer_serverless.syncer.prune import prune
from composer_serverless.syncer.syncer import Syncer
from tests.syncer.test_syncer import hand_config

FRAGMENTS = [["w"], ["b"]]
INITIAL = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.5])}


def sharded_run(tmp_path: Path, name: str, shards: int, **diloco: object) -> tuple[ObjectStore, RunConfig]:
    """Run ``name`` of 3 learners holding version 0 (cut into ``FRAGMENTS`` when sharded)."""
    config = hand_config(tmp_path, str(tmp_path), {"syncer_shards": shards}, **diloco)
    config = config.model_copy(update={"run_id": name})
    run = ObjectStore(str(tmp_path)).child(name)
    run.put(layout.RUN_CONFIG, config.resolved_json().encode())
    if shards > 1:  # as a learner writes it: a snapshot per fragment
        assert versions.commit_fragments(run, Version(0, "initial", fragments=FRAGMENTS), INITIAL, None)
    else:
        assert versions.commit(run, Version(0, "initial"), INITIAL, None, None)
    return run, config


def send(run: ObjectStore, learner: int, seq: int, values: list[float], base: int = 0) -> None:
    """Contribution ``seq`` of ``learner``: (w, w, b) values, whole or as its two fragments."""
    c = Contribution(learner, seq, base, tokens=10, steps=4)
    flat = torch.tensor(values)
    shards = RunConfig.model_validate_json(run.get(layout.RUN_CONFIG)).diloco.decoupled.syncer_shards
    if shards == 1:
        assert versions.publish(run, run.url.rsplit("/", 1)[-1], c, flat, "fp32", None) > 0
    else:
        parts = [(flat[:2], None), (flat[2:], None)]
        assert versions.publish_parts(run, run.url.rsplit("/", 1)[-1], c, parts, "fp32", None) > 0


def shards_of(run: ObjectStore, config: RunConfig) -> list[Syncer]:
    out = []
    for shard in range(config.diloco.decoupled.syncer_shards):
        syncer = Syncer(run, config, None, Reporter(run, 3 + shard), shard=shard)
        syncer._load(versions.read_version(run, 0).version if syncer.newest < 0 else syncer.newest)
        out.append(syncer)
    return out


def merge_all(shards: list[Syncer]) -> None:
    """One version: shard 0 plans, the other shards merge their parts, shard 0 commits."""
    plan = shards[0]._plan()
    for shard in shards[1:]:
        shard._merge_part(versions.read_plan(shard.run_store, plan.version))
    shards[0]._merge_plan(plan)


ROUND_1 = {0: [1.0, 2.0, 3.0], 1: [3.0, 2.0, 1.0], 2: [2.0, 5.0, -1.0]}
ROUND_2 = {0: [1.0, -1.0, 0.5], 1: [0.25, 1.0, 1.0], 2: [1.0, 3.0, -2.0]}


def test_two_shards_merge_what_one_syncer_merges_bit_for_bit(tmp_path: Path) -> None:
    whole, whole_config = sharded_run(tmp_path, "whole", 1)
    sharded, sharded_config = sharded_run(tmp_path, "sharded", 2)
    one = shards_of(whole, whole_config)[0]
    two = shards_of(sharded, sharded_config)
    for seq, values in enumerate([ROUND_1, ROUND_2]):
        for learner, v in values.items():
            send(whole, learner, seq, v, base=seq)
            send(sharded, learner, seq, v, base=seq)
        one._merge(one._gather())
        if seq == 0:
            merge_all(two)
        else:  # restarted shards: from the store, the outer momentum included
            two = shards_of(sharded, sharded_config)
            for shard in two:
                shard._load(1)
            merge_all(two)
    for v in (1, 2):
        a = versions.load_params(whole, versions.read_version(whole, v), None)
        record = versions.read_version(sharded, v)
        b = versions.load_params(sharded, record, None)
        assert list(b) == ["w", "b"] and all(torch.equal(a[n], b[n]) for n in a)
        assert len(record.parts) == 2 and record.fragments == FRAGMENTS
        assert record.merged == [[0, v - 1], [1, v - 1], [2, v - 1]] and record.dropped == []
        assert record.consumed == {0: v, 1: v, 2: v} and record.parent == v - 1
    # the first merge's hand numbers: mean (2, 3, 1), Nesterov's first step lr * 1.25 * g
    first = versions.load_params(sharded, versions.read_version(sharded, 1), None)
    assert torch.equal(first["w"], torch.tensor([1.0 - 0.5 * 1.25 * 2, 2.0 - 0.5 * 1.25 * 3]))
    assert torch.equal(first["b"], torch.tensor([0.5 - 0.5 * 1.25 * 1]))
    # each shard wrote only its fragment: version 2's snapshots hold w, and b, apart
    record = versions.read_version(sharded, 2)
    assert [list(versions.load_part(sharded, record, k, None)) for k in (0, 1)] == FRAGMENTS
    # and each shard holds only its fragment, and the outer momentum over it, restarted or not
    assert [list(shard.params) for shard in two] == FRAGMENTS
    assert [len(shard.outer.state_dict()["state"]) for shard in two] == [1, 1]


def test_every_shard_leaves_out_the_same_outlier_and_a_damaged_fragment_only_in_its_shard(
    tmp_path: Path,
) -> None:
    run, config = sharded_run(tmp_path, "outlier", 2, outlier_norm_factor=10.0)
    shards = shards_of(run, config)
    send(run, 0, 0, [1.0, 1.0, 1.0])
    send(run, 1, 0, [1.0, 2.0, 1.0])
    send(run, 2, 0, [300.0, 400.0, 1.0])  # blown up in fragment 0 only; its fragment 1 looks like the others'
    merge_all(shards)
    record = versions.read_version(run, 1)
    assert record.merged == [[0, 0], [1, 0]]
    assert sorted((d["learner"], d["fragment"]) for d in record.dropped) == [(2, 0), (2, 1)]
    b = versions.load_params(run, record, None)["b"]
    assert torch.equal(b, torch.tensor([0.5 - 0.5 * 1.25 * 1.0]))  # fragment 1 merged only learners 0 and 1

    # Fragment 1 of learner 1's next contribution damaged in the store: shard 1 drops it, shard 0 merges it.
    for learner in range(3):
        send(run, learner, 1, [1.0, 1.0, 1.0], base=1)
    attempt = next(n for n in run.list(layout.contributions(1)) if n.startswith("00000001-"))
    key = f"{layout.contributions(1)}/{attempt.rsplit('-', 1)[0]}-1"
    data = bytearray(run.get(key))
    data[-1] ^= 0xFF
    run.put(key, bytes(data))
    merge_all(shards)
    record = versions.read_version(run, 2)
    assert record.merged == [[0, 1], [2, 1]]  # merged in every fragment
    assert [(d["learner"], d["fragment"]) for d in record.dropped] == [(1, 1)]
    assert "checksum" in record.dropped[0]["why"]


def test_a_restarted_shard_takes_up_the_plan_and_the_parts_that_exist(tmp_path: Path) -> None:
    run, config = sharded_run(tmp_path, "restarted", 2)
    shards = shards_of(run, config)
    for learner, v in ROUND_1.items():
        send(run, learner, 0, v)
    plan = shards[0]._plan()
    shards[1]._merge_part(versions.read_plan(run, 1))
    # shard 0 dies after its plan; a learner's late contribution cannot change what version 1 takes
    send(run, 0, 1, [9.0, 9.0, 9.0], base=0)
    restarted = shards_of(run, config)
    assert restarted[0]._plan() == plan and plan.taken == {0: [0], 1: [0], 2: [0]}
    # shard 1 restarted too: its part exists, so it takes it up instead of merging again
    writer = versions.read_part(run, 1, 1).writer
    restarted[1]._merge_part(plan)
    assert restarted[1].record.writer == writer and restarted[1].newest == 1
    restarted[0]._merge_plan(plan)
    record = versions.read_version(run, 1)
    assert record.parts[1] == writer and record.consumed == {0: 1, 1: 1, 2: 1}
    assert torch.equal(
        versions.load_params(run, record, None)["w"],
        torch.tensor([1.0 - 0.5 * 1.25 * 2, 2.0 - 0.5 * 1.25 * 3]),
    )


def test_a_dead_attempt_at_a_contribution_never_mixes_with_its_redo_and_is_pruned(tmp_path: Path) -> None:
    run, config = sharded_run(tmp_path, "redo", 2)
    send(run, 0, 0, [7.0, 7.0, 7.0])
    run.delete(layout.contribution(0, 0))  # died after its fragments, before the contribution's own object
    assert versions.waiting(run, 3, {}) == {}  # nothing to merge: its parts alone are no contribution
    send(run, 0, 0, [1.0, 2.0, 3.0])
    c, values = versions.read_contribution(run, "redo", 0, 0, "fp32", 2, None, fragment=0)
    assert torch.equal(values, torch.tensor([1.0, 2.0])) and c.norm == pytest.approx(14.0**0.5)
    assert len(run.list(layout.contributions(0))) == 5  # the index and two attempts' two fragments
    prune(run, Version(1, "x", consumed={0: 1}), learners=3, keep=1)
    assert run.list(layout.contributions(0)) == []


def test_a_fragment_must_carry_the_run_keys_mac_and_stay_within_its_stated_whole(tmp_path: Path) -> None:
    run = ObjectStore(str(tmp_path)).child("keyed")
    key, stranger = RunKey(bytes(range(32))), RunKey(bytes(32))
    c = Contribution(0, 0, 0, tokens=10, steps=4)
    parts = [(torch.tensor([3.0, 0.0]), None), (torch.tensor([4.0]), None)]
    assert versions.publish_parts(run, "keyed", c, parts, "fp32", key) > 0
    read, values = versions.read_contribution(run, "keyed", 0, 0, "fp32", 1, key, fragment=1)
    assert torch.equal(values, torch.tensor([4.0])) and read.norm == 5.0 and read.tokens == 10
    attempt = next(n for n in run.list(layout.contributions(0)) if n.endswith("-1")).split("-")[1]
    fragment = layout.contribution_part(0, 0, attempt, 1)
    identity = {"run": "keyed", "kind": "contribution-part", "learner": "0", "seq": "0"}
    identity |= {"attempt": attempt, "fragment": "1"}
    # a fragment written under another key, or none: refused
    for forger in (stranger, None):
        run.put(fragment, bytes(encode(torch.tensor([4.0]), identity, "fp32", forger)))
        with pytest.raises(PayloadError):
            versions.read_contribution(run, "keyed", 0, 0, "fp32", 1, key, fragment=1)
    # under the key, but larger than the whole the header states (5): refused
    run.put(fragment, bytes(encode(torch.tensor([40.0]), identity, "fp32", key)))
    with pytest.raises(PayloadError, match="more than the norm 5"):
        versions.read_contribution(run, "keyed", 0, 0, "fp32", 1, key, fragment=1)
