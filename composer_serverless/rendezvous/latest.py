"""The pointers to global states: ``state/LATEST`` (the newest one, where a replica that fell behind catches
up) and ``state/CHECKPOINT`` (the newest checkpoint, with every replica's own state: where a resume starts).

Each is a small JSON object apart from the checkpoint format, so reading them needs no tensor library (the
launcher reads them too), and each is written only after the state it names is complete (payload first,
marker last). A resume rolls the run back to its checkpoint: whatever the replicas did after it is redone.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.sharding import MAX_QUORUM_GENERATIONS, parse_participants
from composer_serverless.rendezvous.store import ObjectStore

logger = logging.getLogger(__name__)


def latest_round(store: ObjectStore) -> int:
    """The round named by ``state/LATEST``; 0 before any round has been published."""
    return _round(store, layout.LATEST)


def checkpoint_round(store: ObjectStore) -> int:
    """The round named by ``state/CHECKPOINT``; 0 before the first checkpoint."""
    return _round(store, layout.CHECKPOINT)


def kept_checkpoints(store: ObjectStore) -> list[int]:
    """The checkpoints the run keeps, newest first: the one CHECKPOINT names and those before it that it lists
    (``advance``'s ``keep``); empty before the first."""
    newest = checkpoint_round(store)
    if newest == 0:
        return []
    try:
        listed = json.loads(store.get(layout.CHECKPOINT)).get("kept", [])
    except (FileNotFoundError, ValueError, AttributeError):
        listed = []
    older = {k for k in listed if isinstance(k, int) and not isinstance(k, bool) and 0 < k < newest}
    return [newest, *sorted(older, reverse=True)]


def advance(store: ObjectStore, round_index: int, *, checkpoint: bool, keep: int = 2) -> None:
    """Point LATEST (and with ``checkpoint`` CHECKPOINT, which lists the ``keep`` newest checkpoints) at
    ``round_index``, whose state is written; never backwards. A publisher slower than the next round's leaves
    them alone: a reader then sees a slightly older, still complete, state."""
    if _round(store, layout.LATEST) < round_index:
        store.put(layout.LATEST, json.dumps({"round": round_index}).encode())
    if checkpoint and checkpoint_round(store) < round_index:
        _point_checkpoint(store, [round_index, *kept_checkpoints(store)][:keep])


def _point_checkpoint(store: ObjectStore, kept: list[int]) -> None:
    store.put(layout.CHECKPOINT, json.dumps({"round": kept[0] if kept else 0, "kept": kept}).encode())


def newest_round(store: ObjectStore) -> int:
    """The newest round whose first sync has its participants fixed; 0 before the first. A round directory
    without a readable quorum (replicas still arriving, or objects something else wrote there) does not count:
    otherwise one stray object under ``rounds/99`` would make every replica think the run is far ahead."""
    for round_index in sorted((int(n) for n in store.list(layout.ROUNDS) if n.isdigit()), reverse=True):
        if fixed_participants(store, round_index, 0) is not None:
            return round_index
    return 0


def newest_version(store: ObjectStore) -> int:
    """A decoupled run's newest global version recorded; -1 before version 0 exists. Here, not with the
    versions' tensors (``rendezvous/decoupled.py``), so the launcher can ask it without loading torch."""
    names = [n.removesuffix(".json") for n in store.list(layout.VERSIONS) if n.endswith(".json")]
    return max((int(n) for n in names if n.isdigit()), default=-1)


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


class NoIntactState(RuntimeError):
    """A resume found global states in the run, and none of them whole."""


@dataclass(frozen=True)
class RollBack:
    """Where a resume starts, whether that is the checkpoint CHECKPOINT named (with every replica's own state
    beside it), and the states it passed over (each with what is wrong with it)."""

    round: int
    checkpoint: bool = True
    skipped: tuple[str, ...] = ()


def roll_back(
    store: ObjectStore, local_ranks: int = 1, before_change: Callable[[], None] = lambda: None
) -> RollBack:
    """Make the newest intact checkpoint the latest state again, for a resume of a run whose replicas all
    died. Global states, exchanges, evaluations and heal requests of later rounds are deleted: the resumed
    replicas redo those rounds from it, as an uninterrupted run did them.

    The state CHECKPOINT names is used if every part of it (``local_ranks``) is whole (its manifest readable
    and every file of the size it lists). Otherwise, and when the pointer itself is unreadable, the newest
    whole state is: an older kept checkpoint (``advance``'s ``keep``), or a state between checkpoints, which
    has no replica states beside it, so the replicas resume it with their older own states, or fresh inner
    optimizers, rather than not at all. Nothing is deleted before that choice is made. ``before_change`` is
    called before each change to the store (a rollback's claimant stops there once its lease has run out).

    Raises:
        NoIntactState: the run has global states and not one of them is whole.
    """
    rounds = sorted((int(n) for n in store.list(layout.STATE) if n.isdigit()), reverse=True)
    kept = kept_checkpoints(store)
    pointed = checkpoint_round(store)
    skipped: list[str] = []
    chosen = 0
    candidates = ([pointed] if pointed else []) + [k for k in rounds if k != pointed]
    for round_index in candidates:
        problem = _incomplete(store, round_index, local_ranks)
        if problem is None:
            chosen = round_index
            break
        skipped.append(f"{layout.STATE}/{round_index}: {problem}")
    else:
        if candidates:  # the run got somewhere: starting it over from round 0 is not a resume
            raise NoIntactState(f"{store.url}: no global state can be resumed from: " + "; ".join(skipped))
    for prefix in (layout.STATE, layout.ROUNDS, layout.EVALS):
        for name in store.list(prefix):
            if name.isdigit() and int(name) > chosen:
                before_change()
                store.delete(f"{prefix}/{name}")
    before_change()
    store.delete(layout.HEAL)
    if _round(store, layout.LATEST) != chosen:
        before_change()
        store.put(layout.LATEST, json.dumps({"round": chosen}).encode())
    if pointed != chosen:
        before_change()
        _point_checkpoint(store, [chosen, *(k for k in kept if k < chosen)] if chosen else [])
    return RollBack(chosen, chosen in kept, tuple(skipped))


def _incomplete(store: ObjectStore, round_index: int, local_ranks: int) -> str | None:
    """What makes the global state of ``round_index`` unusable, or None if every part of it is whole."""
    for local in range(local_ranks):
        prefix = layout.global_state(round_index, local)
        try:
            manifest = json.loads(store.get(layout.snapshot_file(prefix, layout.SNAPSHOT_MANIFEST)))
            files = manifest["files"]
            sizes = {name: int(entry["bytes"]) for name, entry in files.items()}
        except FileNotFoundError:
            return f"part {local} has no manifest (it was never finished, or was deleted)"
        except (ValueError, KeyError, TypeError, AttributeError):
            return f"the manifest of part {local} is unreadable"
        for name, size in sizes.items():
            try:
                actual = store.size(layout.snapshot_file(prefix, name))
            except FileNotFoundError:
                return f"{name} of part {local} is missing"
            except ValueError:  # a name that is not a key of the state's own (``../``, say)
                return f"the manifest of part {local} names {name!r}, not a file of the state"
            if actual != size:
                return f"{name} of part {local} is {actual} bytes, its manifest says {size}"
    return None


def _round(store: ObjectStore, key: str) -> int:
    """The round a pointer names; 0 when it is absent, and when it is not a pointer (garbage): the next
    publish rewrites it, and a resume finds its state by looking at the states themselves."""
    try:
        raw = store.get(key)
    except FileNotFoundError:
        return 0
    try:
        round_index = json.loads(raw)["round"]
    except (ValueError, KeyError, TypeError):
        round_index = None
    if isinstance(round_index, int) and not isinstance(round_index, bool) and round_index >= 0:
        return round_index
    logger.warning("%s is not a round pointer (%r); treating it as absent", store.url_of(key), raw[:80])
    return 0
