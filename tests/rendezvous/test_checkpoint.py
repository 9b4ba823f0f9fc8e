"""Checkpoints in the store: pickle-free state dicts, manifests, LATEST, pruning, per-replica fallback."""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from composer_serverless.rendezvous import checkpoint, latest
from composer_serverless.rendezvous.checkpoint import CheckpointError, flatten, unflatten
from composer_serverless.rendezvous.store import ObjectStore


def optimizer_states() -> dict:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    adamw = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.8, 0.9))
    sgd = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    model(torch.randn(5, 3)).sum().backward()
    adamw.step()
    sgd.step()
    schedule = torch.optim.lr_scheduler.LambdaLR(adamw, lambda step: 0.5**step)
    return {
        "adamw": adamw.state_dict(),
        "sgd": sgd.state_dict(),
        "schedule": schedule.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        "nested": [{"a": (1, 2.5, None, True)}, "text"],
    }


def assert_same(a, b) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def test_flatten_round_trips_optimizer_states_through_json_and_safetensors(tmp_path: Path) -> None:
    state = optimizer_states()
    skeleton, tensors = flatten(state)
    json.dumps(skeleton)  # the skeleton is plain JSON
    assert all(isinstance(t, torch.Tensor) for t in tensors.values())
    assert_same(unflatten(json.loads(json.dumps(skeleton)), tensors), state)
    # And loadable into fresh optimizers (int keys and tuples survived).
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    torch.optim.AdamW(model.parameters()).load_state_dict(unflatten(skeleton, tensors)["adamw"])


def test_flatten_refuses_what_it_cannot_represent() -> None:
    with pytest.raises(TypeError):
        flatten({"f": lambda: 0})
    with pytest.raises(TypeError):
        flatten({(1, 2): "tuple key"})


@pytest.fixture(params=["file", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    return ObjectStore(
        f"file://{tmp_path}/run" if request.param == "file" else f"memory://ckpt-{tmp_path.name}"
    )


def test_snapshots_are_checked_against_their_manifest(store: ObjectStore) -> None:
    state = optimizer_states()
    checkpoint.write_snapshot(store, "snap", state)
    assert_same(checkpoint.read_snapshot(store, "snap"), state)
    tensors = bytearray(store.get("snap/tensors.safetensors"))
    tensors[-1] ^= 1
    store.put("snap/tensors.safetensors", tensors)
    with pytest.raises(CheckpointError, match="checksum"):
        checkpoint.read_snapshot(store, "snap")
    store.put("snap/manifest.json", b"not json")
    with pytest.raises(CheckpointError, match="manifest"):
        checkpoint.read_snapshot(store, "snap")
    with pytest.raises(FileNotFoundError):
        checkpoint.read_snapshot(store, "absent")


def test_latest_moves_forward_only_and_old_states_are_pruned_but_the_checkpoints(store: ObjectStore) -> None:
    assert latest.latest_round(store) == 0 and latest.checkpoint_round(store) == 0
    for k in range(1, 7):
        store.put(f"rounds/{k}/0/quorum.json", b'{"participants": [0]}')
        written = checkpoint.write_global(store, k, {"step": k})
        checkpoint.advance(store, k, checkpoint=k == 2)
        checkpoint.prune_exchanges(store, k)
        assert written == sum(store.size(f"state/{k}/0/{name}") for name in store.list(f"state/{k}/0"))
    assert (latest.latest_round(store), latest.checkpoint_round(store)) == (6, 2)
    checkpoint.write_global(store, 3, {"step": 3})  # a slow publisher of an older round
    checkpoint.advance(store, 3, checkpoint=True)
    assert (latest.latest_round(store), latest.checkpoint_round(store)) == (6, 3)
    # The two newest checkpoints (3, rewritten late, and 2) and the last two states are kept; exchanges: the
    # last two.
    assert sorted(store.list("state")) == ["2", "3", "5", "6", "CHECKPOINT", "LATEST"]
    assert latest.kept_checkpoints(store) == [3, 2]
    assert sorted(store.list("rounds")) == ["5", "6"]
    assert checkpoint.load_global(store, 6) == {"step": 6}


@pytest.mark.parametrize(("keep", "kept"), [(2, ["5", "6"]), (4, ["3", "4", "5", "6"])])
def test_rollouts_are_kept_as_long_as_a_live_harvest_may_still_read_them(
    store: ObjectStore, keep: int, kept: list[str]
) -> None:
    for k in range(1, 7):
        store.put(f"rounds/{k}/0/quorum.json", b'{"participants": [0]}')
        store.put(f"rollouts/{k}/0.jsonl", b"")
        checkpoint.prune_exchanges(store, k, keep_rollouts=keep)
    assert sorted(store.list("rollouts")) == kept
    assert sorted(store.list("rounds")) == ["5", "6"]  # the exchanges: the last two, whatever the harvest


def test_a_resume_rolls_the_run_back_to_its_checkpoint(store: ObjectStore) -> None:
    for k in range(1, 6):
        store.put(f"rounds/{k}/0/quorum.json", b'{"participants": [0]}')
        store.put(f"evals/{k}/0-of-1.json", b"{}")
        checkpoint.write_global(store, k, {"step": k})
        checkpoint.advance(store, k, checkpoint=k % 2 == 0)
    store.put("heal/1.json", b'{"rank": 1, "round": 5}')
    assert latest.roll_back(store) == latest.RollBack(4)
    assert latest.latest_round(store) == 4 and latest.newest_round(store) == 4
    assert sorted(store.list("state")) == ["2", "4", "CHECKPOINT", "LATEST"]  # checkpoints 4 and 2 kept
    assert "5" not in store.list("evals") and store.list("heal") == []


def test_a_replica_falls_back_to_its_newest_readable_state(store: ObjectStore) -> None:
    for k in (1, 2, 3):
        checkpoint.save_replica(store, 0, k, {"round": k})
    assert checkpoint.load_replica(store, 0, 3) == (3, {"round": 3})
    assert checkpoint.load_replica(store, 0, 2) == (2, {"round": 2})
    store.delete("replicas/0/3/0/manifest.json")  # died while writing round 3
    assert checkpoint.load_replica(store, 0, 3) == (2, {"round": 2})
    store.put("replicas/0/2/0/state.json", b"{}")  # corrupt
    assert checkpoint.load_replica(store, 0, 3) == (1, {"round": 1})
    assert checkpoint.load_replica(store, 1, 3) is None


def test_the_ranks_of_a_replica_resume_from_a_round_every_one_of_them_can_read(store: ObjectStore) -> None:
    """Local rank 1 died while writing round 3: both ranks take round 2, though rank 0's round 3 is whole."""
    for k in (1, 2, 3):
        for local in (0, 1):
            checkpoint.save_replica(store, 0, k, {"round": k, "local": local}, local)
    store.delete("replicas/0/3/1/manifest.json")
    barrier, flags = threading.Barrier(2), [False, False]

    def agree(local: int) -> Callable[[bool], bool]:
        def all_readable(readable: bool) -> bool:
            flags[local] = readable
            barrier.wait()
            agreed = all(flags)
            barrier.wait()
            return agreed

        return all_readable

    found: dict[int, object] = {}
    ranks = [
        threading.Thread(
            target=lambda rank=local: found.update(
                {rank: checkpoint.load_replica(store, 0, 3, rank, agree(rank))}
            )
        )
        for local in (0, 1)
    ]
    for thread in ranks:
        thread.start()
    for thread in ranks:
        thread.join(timeout=30)
    assert found == {local: (2, {"round": 2, "local": local}) for local in (0, 1)}


def test_a_round_counts_as_started_only_once_its_quorum_is_fixed(store: ObjectStore) -> None:
    """Objects something else wrote under a later round (a stray input, a garbage quorum) do not make the
    replicas think the run is ahead of them; a malformed record followed by a valid one does count."""
    store.put("rounds/1/0/quorum.json", b'{"participants": [0, 1]}')
    store.put("rounds/2/0/0/in/1-0", b"stray")
    store.put("rounds/99/0/quorum.json", b"\x00garbage")
    assert latest.newest_round(store) == 1
    store.put("rounds/2/0/quorum.json", b"[]")
    store.put("rounds/2/0/quorum-1.json", b'{"participants": [1]}')
    assert latest.newest_round(store) == 2
    assert latest.fixed_participants(store, 2, 0) == [1]
    assert latest.fixed_participants(store, 2, 0, replicas=1) is None  # rank 1 of 1 replica: not a quorum


def _published(store: ObjectStore, rounds: int, local_ranks: int = 1) -> None:
    """Rounds 1..``rounds`` published as a run does, a checkpoint every other round, ``local_ranks`` parts."""
    for k in range(1, rounds + 1):
        for local in range(local_ranks):
            checkpoint.write_global(store, k, {"step": k, "local": local}, local)
        checkpoint.advance(store, k, checkpoint=k % 2 == 0)


@pytest.mark.parametrize(
    ("damage", "resumed", "why"),
    [
        ("checkpoint-garbage", 5, None),  # the pointer unreadable: the states themselves are looked at
        ("checkpoint-past-the-end", 5, "state/99: part 0 has no manifest"),
        ("checkpoint-deleted", 5, "state/4: part 0 has no manifest"),
        ("checkpoint-truncated", 5, "state/4: tensors.safetensors of part 1 is 3 bytes"),
        ("checkpoint-manifest-escapes", 5, "state/4: the manifest of part 0 names '../../x'"),
        ("latest-garbage", 4, None),
    ],
)
def test_a_resume_starts_from_the_newest_intact_state(store: ObjectStore, damage, resumed, why) -> None:
    """Two parts per state (a replica of 2 ranks); states 4 (the checkpoint) and 5 (the latest) kept."""
    _published(store, 5, local_ranks=2)
    if damage == "checkpoint-garbage":
        store.put("state/CHECKPOINT", b"\x00\xff")
    elif damage == "checkpoint-past-the-end":
        store.put("state/CHECKPOINT", b'{"round": 99}')
    elif damage == "checkpoint-deleted":
        store.delete("state/4")
    elif damage == "checkpoint-manifest-escapes":
        store.put("state/4/0/manifest.json", b'{"files": {"../../x": {"bytes": 1, "sha256": "0"}}}')
    elif damage == "checkpoint-truncated":
        store.put("state/4/1/tensors.safetensors", b"abc")
    else:
        store.put("state/LATEST", b"\x00garbage")
        assert latest.latest_round(store) == 0  # read as absent, not a crash
    back = latest.roll_back(store, local_ranks=2)
    assert back.round == resumed
    assert (why is None and not back.skipped) or (why is not None and why in back.skipped[0]), back
    assert back.checkpoint == (damage == "latest-garbage")  # else state 5, which has no replica states
    assert latest.latest_round(store) == resumed == latest.checkpoint_round(store)
    assert checkpoint.load_global(store, resumed, 1) == {"step": resumed, "local": 1}


def test_a_resume_with_no_intact_state_says_so_and_deletes_nothing(store: ObjectStore) -> None:
    _published(store, 3)
    for k in ("2", "3"):
        store.delete(f"state/{k}/0/manifest.json")
    with pytest.raises(latest.NoIntactState, match=r"state/2: part 0 has no manifest.*state/3: part 0"):
        latest.roll_back(store)
    assert sorted(store.list("state")) == ["2", "3", "CHECKPOINT", "LATEST"]


@pytest.mark.parametrize(("keep", "kept"), [(2, [6, 4]), (3, [6, 4, 2])])
def test_the_last_k_checkpoints_are_kept_with_every_replica_state_beside_them(
    store: ObjectStore, keep: int, kept: list[int]
) -> None:
    """A checkpoint every other round of 7, keeping ``keep``: their global states, the newest two states, and
    each replica's own states from the oldest kept checkpoint on survive; everything older is pruned."""
    for k in range(1, 8):
        checkpoint.write_global(store, k, {"step": k})
        checkpoint.advance(store, k, checkpoint=k % 2 == 0, keep=keep)
        if k % 2 == 0:
            checkpoint.save_replica(store, 0, k, {"round": k})
    assert latest.kept_checkpoints(store) == kept
    assert sorted(int(n) for n in store.list("state") if n.isdigit()) == sorted({*kept, 6, 7})
    assert sorted(int(n) for n in store.list("replicas/0")) == sorted(kept)


def test_a_truncated_newest_checkpoint_falls_back_to_the_one_before(store: ObjectStore) -> None:
    """A state published only at checkpoints (every other round), as a run with no replica behind does:
    checkpoints 4 and 6 kept; 6's tensors truncated: the resume takes checkpoint 4, and the checkpoint
    pointer then lists what is left."""
    for k in range(2, 7, 2):
        checkpoint.write_global(store, k, {"step": k})
        checkpoint.advance(store, k, checkpoint=True)
    store.put("state/6/0/tensors.safetensors", b"abc")
    back = latest.roll_back(store)
    assert back.round == 4 and back.checkpoint and "state/6: tensors.safetensors" in back.skipped[0]
    assert latest.latest_round(store) == 4 and latest.kept_checkpoints(store) == [4]
    assert checkpoint.load_global(store, 4) == {"step": 4}
