"""A starting replica passes over a damaged published state for the newest whole one before it, instead of
failing on it at every restart; a replica catching up mid-run does not go backwards."""

from __future__ import annotations

import pytest

from composer_serverless.rendezvous import checkpoint
from composer_serverless.rendezvous.checkpoint import CheckpointError
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.replicas import state


@pytest.fixture
def store(tmp_path) -> ObjectStore:
    store = ObjectStore(str(tmp_path))
    for k in (1, 2, 3):
        checkpoint.write_global(store, k, {"step": k})
        checkpoint.advance(store, k, checkpoint=True)
    store.put("state/3/0/tensors.safetensors", b"damaged")
    return store


def test_a_starting_replica_falls_back_to_the_newest_whole_state(store: ObjectStore, caplog) -> None:
    assert state.load_global(store, 3, fall_back=True) == {"step": 2}
    assert "the state of round 3 cannot be read; starting from that of round 2" in caplog.text


def test_without_fall_back_a_damaged_state_is_an_error_naming_it(store: ObjectStore) -> None:
    with pytest.raises(CheckpointError, match=r"round 3: .*state/3/0/tensors.safetensors does not match"):
        state.load_global(store, 3)


def test_with_nothing_whole_the_error_names_every_state_tried(store: ObjectStore) -> None:
    assert sorted(store.list("state")) == ["2", "3", "CHECKPOINT", "LATEST"]  # older states are pruned
    store.delete("state/2/0/manifest.json")
    with pytest.raises(
        CheckpointError, match=r"round 3: .* checksum; round 2: not in the store \(pruned[^;]*$"
    ):
        state.load_global(store, 3, fall_back=True)
