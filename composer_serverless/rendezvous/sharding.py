"""Who owns, reduces and holds which part of a flat tensor in the exchange: pure functions every replica
computes alike, so they agree without talking."""

from __future__ import annotations

import json

from composer_serverless.rendezvous import layout


def shard_bounds(numel: int, shards: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges of ``shards`` near-equal shards of ``numel`` values (some may be empty)."""
    return [(s * numel // shards, (s + 1) * numel // shards) for s in range(shards)]


def complete_ranks(keys: set[str], replicas: int, local_ranks: int = 1) -> list[int]:
    """Replicas whose N input shards are all present among ``keys`` (relative to the sync prefix), for every
    one of their ``local_ranks`` parts: a replica takes part in a sync whole or not at all."""
    return [
        r
        for r in range(replicas)
        if all(
            layout.sync_input(r, s, local) in keys for s in range(replicas) for local in range(local_ranks)
        )
    ]


def substitute_for(shard: int, participants: list[int]) -> int:
    """The participant that reduces ``shard`` when its owner is not a participant: a fixed function of the
    quorum, so every replica names the same one and only it downloads the shard's inputs."""
    return participants[shard % len(participants)]


# Malformed quorum records of one sync passed over before the exchange gives up (``layout.quorum_generation``).
MAX_QUORUM_GENERATIONS = 4


def parse_participants(raw: bytes, replicas: int | None) -> list[int] | None:
    """The participants a quorum record names, or None if it is not one: JSON with a sorted, duplicate-free,
    non-empty list of ranks (in ``[0, replicas)`` when ``replicas`` is given) under ``participants``."""
    try:
        doc = json.loads(raw)
    except ValueError:  # not JSON, or not UTF-8
        return None
    participants = doc.get("participants") if isinstance(doc, dict) else None
    if (
        not isinstance(participants, list)
        or not participants
        or any(not isinstance(p, int) or isinstance(p, bool) or p < 0 for p in participants)
        or (replicas is not None and participants[-1] >= replicas)
        or participants != sorted(set(participants))
    ):
        return None
    return participants
