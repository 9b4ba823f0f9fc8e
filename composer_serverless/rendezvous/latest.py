"""``state/LATEST``: the round of the newest complete global state, where every resume and catch-up starts.

The replicas read it to resume and to notice that they are behind; the launcher reads it to say where a
resume starts. It is a small JSON object apart from the checkpoint format, so reading it needs no tensor
library. It is written only after the state it names is complete (payload first, marker last).
"""

from __future__ import annotations

import json

from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import ObjectStore


def latest_round(store: ObjectStore) -> int:
    """The round named by ``state/LATEST``; 0 before any round has been published."""
    try:
        return int(json.loads(store.get(layout.LATEST))["round"])
    except FileNotFoundError:
        return 0


def advance(store: ObjectStore, round_index: int) -> None:
    """Point LATEST at ``round_index``, whose state is already written; never backwards.

    A publisher slower than the next round's publisher leaves LATEST alone: a reader then sees a slightly
    older, still complete, state.
    """
    if latest_round(store) < round_index:
        store.put(layout.LATEST, json.dumps({"round": round_index}).encode())
