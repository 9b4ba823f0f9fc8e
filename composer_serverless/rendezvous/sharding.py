"""Who owns, reduces and holds which part of a flat tensor in the exchange: pure functions every replica
computes alike, so they agree without talking."""

from __future__ import annotations

from composer_serverless.rendezvous import layout


def shard_bounds(numel: int, shards: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges of ``shards`` near-equal shards of ``numel`` values (some may be empty)."""
    return [(s * numel // shards, (s + 1) * numel // shards) for s in range(shards)]


def complete_ranks(keys: set[str], replicas: int) -> list[int]:
    """Ranks whose N input shards are all present among ``keys`` (relative to the sync prefix)."""
    return [r for r in range(replicas) if all(layout.sync_input(r, s) in keys for s in range(replicas))]


def substitute_for(shard: int, participants: list[int]) -> int:
    """The participant that reduces ``shard`` when its owner is not a participant: a fixed function of the
    quorum, so every replica names the same one and only it downloads the shard's inputs."""
    return participants[shard % len(participants)]
