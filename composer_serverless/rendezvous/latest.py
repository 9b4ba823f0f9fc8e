"""The pointers to global states: ``state/LATEST`` (the newest one, where a replica that fell behind catches
up) and ``state/CHECKPOINT`` (the newest checkpoint, with every replica's own state: where a resume starts).

Each is a small JSON object apart from the checkpoint format, so reading them needs no tensor library (the
launcher reads them too), and each is written only after the state it names is complete (payload first,
marker last). A resume rolls the run back to its checkpoint: whatever the replicas did after it is redone.
"""

from __future__ import annotations

import json

from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.sharding import MAX_QUORUM_GENERATIONS, parse_participants
from composer_serverless.rendezvous.store import ObjectStore


def latest_round(store: ObjectStore) -> int:
    """The round named by ``state/LATEST``; 0 before any round has been published."""
    return _round(store, layout.LATEST)


def checkpoint_round(store: ObjectStore) -> int:
    """The round named by ``state/CHECKPOINT``; 0 before the first checkpoint."""
    return _round(store, layout.CHECKPOINT)


def advance(store: ObjectStore, round_index: int, *, checkpoint: bool) -> None:
    """Point LATEST (and with ``checkpoint`` CHECKPOINT) at ``round_index``, whose state is written; never
    backwards. A publisher slower than the next round's leaves them alone: a reader then sees a slightly
    older, still complete, state."""
    for key, moves in ((layout.LATEST, True), (layout.CHECKPOINT, checkpoint)):
        if moves and _round(store, key) < round_index:
            store.put(key, json.dumps({"round": round_index}).encode())


def newest_round(store: ObjectStore) -> int:
    """The newest round whose first sync has its participants fixed; 0 before the first. A round directory
    without a readable quorum (replicas still arriving, or objects something else wrote there) does not count:
    otherwise one stray object under ``rounds/99`` would make every replica think the run is far ahead."""
    for round_index in sorted((int(n) for n in store.list(layout.ROUNDS) if n.isdigit()), reverse=True):
        if fixed_participants(store, round_index, 0) is not None:
            return round_index
    return 0


def fixed_participants(
    store: ObjectStore, round_index: int, fragment: int, replicas: int | None = None
) -> list[int] | None:
    """The participants of the sync's first readable quorum record (passing over malformed ones, as the
    exchange does), or None if it has none."""
    for generation in range(MAX_QUORUM_GENERATIONS):
        try:
            raw = store.get(layout.quorum(round_index, fragment, generation))
        except FileNotFoundError:
            return None
        participants = parse_participants(raw, replicas)
        if participants is not None:
            return participants
    return None


def roll_back(store: ObjectStore) -> int:
    """Make the newest checkpoint the latest state again, for a resume of a run whose replicas all died;
    returns its round. Global states, exchanges, evaluations and heal requests of later rounds are deleted:
    the resumed replicas redo those rounds from the checkpoint, as an uninterrupted run did them."""
    round_index = checkpoint_round(store)
    for prefix in (layout.STATE, layout.ROUNDS, layout.EVALS):
        for name in store.list(prefix):
            if name.isdigit() and int(name) > round_index:
                store.delete(f"{prefix}/{name}")
    store.delete(layout.HEAL)
    if latest_round(store) != round_index:
        store.put(layout.LATEST, json.dumps({"round": round_index}).encode())
    return round_index


def _round(store: ObjectStore, key: str) -> int:
    try:
        return int(json.loads(store.get(key))["round"])
    except FileNotFoundError:
        return 0
