"""The changes resumes made to a run's ``run.json`` (``launch --resume RUN --set key=value``): from which
round on, which keys, from what to what. ``run.json`` holds only the configuration now in force; this record
(``layout.CONFIG_CHANGES``) says where it began, so the report of a run whose learning rate or length changed
half-way says so. Only the launcher writes it, while no replica of the run is live."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import ObjectStore

logger = logging.getLogger(__name__)


def record(store: ObjectStore, resumed_round: int, changed: dict[str, tuple[Any, Any]]) -> None:
    """Add a resume's ``changed`` keys ((old, new) by dotted key) to the record: the rounds after
    ``resumed_round`` run with the new values."""
    entry = {
        "round": resumed_round,
        "time": time.time(),
        "changes": {key: {"from": old, "to": new} for key, (old, new) in changed.items()},
    }
    store.put(layout.CONFIG_CHANGES, json.dumps({"changes": [*read(store), entry]}, indent=1).encode())


def read(store: ObjectStore) -> list[dict[str, Any]]:
    """Every change recorded, oldest first: ``{"round", "time", "changes": {key: {"from", "to"}}}``."""
    try:
        raw = store.get(layout.CONFIG_CHANGES)
    except FileNotFoundError:
        return []
    try:
        entries = json.loads(raw)["changes"]
        if isinstance(entries, list) and all(isinstance(e, dict) for e in entries):
            return entries
    except (ValueError, KeyError, TypeError):
        pass
    logger.warning(
        "%s is not a record of config changes (%r); reading it as none",
        store.url_of(layout.CONFIG_CHANGES),
        raw[:80],
    )
    return []
