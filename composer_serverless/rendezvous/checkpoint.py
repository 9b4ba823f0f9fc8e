"""Checkpoints in the store: the global state per round, the ``state/LATEST`` pointer, per-replica state.

After each committed round the lowest-rank participant publishes ``state/{k}/`` (the global parameters and
outer-optimizer state of every fragment, and the sync step) and only then moves ``state/LATEST``: payload
first, marker last, so LATEST always names a complete state. Each replica also keeps what is its own,
``replicas/{rank}/{k}/`` (inner optimizer, learning-rate schedule, RNG, data position, and its local
parameters where they differ from the global ones), so that a run whose replicas all died resumes exactly
where it stopped.

A snapshot directory holds ``tensors.safetensors`` (every tensor), ``state.json`` (everything else, with
markers where the tensors were) and, written last, ``manifest.json`` (size and sha256 of both). Reading
checks the manifest; nothing is unpickled. With a run key (``diloco.authenticate``) each file's entry holds a
keyed BLAKE3 MAC of the snapshot's prefix, the file's name and its bytes instead of the sha256, and a reader
with the key refuses a snapshot any file of which has no valid MAC: a state written without the key is never
loaded, nor one moved to another round's or replica's prefix. ``flatten``/``unflatten`` turn a nested ``state_dict`` (dicts
with int or str keys, lists, tuples, scalars, tensors) into that pair and back.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from typing import Any

import safetensors.torch
import torch

from composer_serverless.rendezvous import latest, layout
from composer_serverless.rendezvous.runkey import MAC_FIELD, RunKey, framed
from composer_serverless.rendezvous.store import ObjectStore

logger = logging.getLogger(__name__)

# Exchange objects of this many recent rounds are kept, so a replica that is a little behind can still
# take a round's result from the store; an older one catches up from state/LATEST instead.
KEEP_ROUNDS = 2
KEEP_STATES = 2


class CheckpointError(RuntimeError):
    """A checkpoint in the store is incomplete, corrupt or does not fit this model."""


# --- pickle-free (de)serialisation of state dicts ----------------------------------------------------


def flatten(tree: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """Split ``tree`` into a JSON-serialisable skeleton and its tensors (named ``t0``, ``t1``, ...).

    Every JSON object in the skeleton is a marker, so no user key can be mistaken for one:
    ``{"__tensor__": name}``, ``{"__tuple__": [...]}``, ``{"__dict__": [[key, value], ...]}`` (keys keep
    their type, so optimizer states keyed by int survive).

    Raises:
        TypeError: ``tree`` holds something other than dict, list, tuple, str, int, float, bool, None, Tensor.
    """
    tensors: dict[str, torch.Tensor] = {}

    def walk(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            name = f"t{len(tensors)}"
            tensors[name] = node.detach().cpu().contiguous()
            return {"__tensor__": name}
        if isinstance(node, dict):
            for key in node:
                if not isinstance(key, (str, int)) or isinstance(key, bool):
                    raise TypeError(f"cannot checkpoint a dict key of type {type(key).__name__}: {key!r}")
            return {"__dict__": [[key, walk(value)] for key, value in node.items()]}
        if isinstance(node, tuple):
            return {"__tuple__": [walk(v) for v in node]}
        if isinstance(node, list):
            return [walk(v) for v in node]
        if node is None or isinstance(node, (str, int, float, bool)):
            return node
        raise TypeError(f"cannot checkpoint a value of type {type(node).__name__}")

    return walk(tree), tensors


def unflatten(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of ``flatten``."""
    if isinstance(skeleton, list):
        return [unflatten(v, tensors) for v in skeleton]
    if not isinstance(skeleton, dict):
        return skeleton
    if set(skeleton) == {"__tensor__"}:
        name = skeleton["__tensor__"]
        if name not in tensors:
            raise CheckpointError(f"state refers to tensor {name!r}, which the snapshot does not hold")
        return tensors[name]
    if set(skeleton) == {"__tuple__"}:
        return tuple(unflatten(v, tensors) for v in skeleton["__tuple__"])
    if set(skeleton) == {"__dict__"}:
        return {key: unflatten(value, tensors) for key, value in skeleton["__dict__"]}
    raise CheckpointError(f"unexpected object in checkpoint state: {sorted(skeleton)}")


# --- snapshots -----------------------------------------------------------------------------------------


def write_snapshot(store: ObjectStore, prefix: str, tree: Any, key: RunKey | None = None) -> int:
    """Write ``tree`` under ``prefix/``; the manifest goes last, so its presence means the snapshot is whole.
    With ``key`` the manifest holds each file's MAC instead of its sha256. Returns the bytes written."""
    skeleton, tensors = flatten(tree)
    files = {
        layout.SNAPSHOT_TENSORS: safetensors.torch.save(tensors),
        layout.SNAPSHOT_STATE: json.dumps(skeleton).encode(),
    }
    for name, data in files.items():
        store.put(layout.snapshot_file(prefix, name), data)
    manifest = {
        name: {"bytes": len(data), **_digest(prefix, name, data, key)} for name, data in files.items()
    }
    manifest_bytes = json.dumps({"files": manifest}, indent=1).encode()
    store.put(layout.snapshot_file(prefix, layout.SNAPSHOT_MANIFEST), manifest_bytes)
    return sum(len(data) for data in files.values()) + len(manifest_bytes)


def _digest(prefix: str, name: str, data: bytes, key: RunKey | None) -> dict[str, str]:
    """A file's manifest entry beside its size: its sha256, or with ``key`` its MAC (bound to where it lies)."""
    if key is None:
        return {"sha256": hashlib.sha256(data).hexdigest()}
    return {MAC_FIELD: key.mac([framed(f"{prefix}/{name}"), data])}


def _matches(prefix: str, name: str, data: bytes, expected: dict[str, Any], key: RunKey | None) -> bool:
    if len(data) != expected["bytes"]:
        return False
    if key is None:
        return hashlib.sha256(data).hexdigest() == expected["sha256"]
    return key.verify(expected.get(MAC_FIELD), [framed(f"{prefix}/{name}"), data])


def read_snapshot(store: ObjectStore, prefix: str, key: RunKey | None = None) -> Any:
    """Read a snapshot written by ``write_snapshot``, checking every file against the manifest (with ``key``,
    its MAC: a snapshot written without the run's key is refused).

    Raises:
        FileNotFoundError: there is no complete snapshot under ``prefix``.
        CheckpointError: a file is missing, of the wrong size, or fails its checksum or MAC.
    """
    raw = store.get(layout.snapshot_file(prefix, layout.SNAPSHOT_MANIFEST))
    try:
        manifest = json.loads(raw)["files"]
        if set(manifest) != {layout.SNAPSHOT_TENSORS, layout.SNAPSHOT_STATE}:
            raise ValueError(f"it lists {sorted(manifest)}")
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"{store.url_of(prefix)}/{layout.SNAPSHOT_MANIFEST} is not a valid manifest: {e}"
        ) from e
    files = {}
    for name, expected in manifest.items():
        try:
            data = store.get(layout.snapshot_file(prefix, name))
        except FileNotFoundError as e:
            raise CheckpointError(
                f"{store.url_of(prefix)}/{name} is listed in the manifest but missing"
            ) from e
        try:
            matches = _matches(prefix, name, data, expected, key)
        except (KeyError, TypeError) as e:
            raise CheckpointError(
                f"{store.url_of(prefix)}/{layout.SNAPSHOT_MANIFEST} is malformed: {e}"
            ) from e
        if not matches:
            raise CheckpointError(
                f"{store.url_of(prefix)}/{name} does not match its manifest "
                + ("checksum" if key is None else "MAC (not written with this run's key, or corrupted)")
            )
        files[name] = data
    try:
        tensors = safetensors.torch.load(files[layout.SNAPSHOT_TENSORS])
    except Exception as e:  # safetensors raises its own error type for every malformed layout
        raise CheckpointError(
            f"{store.url_of(prefix)}/{layout.SNAPSHOT_TENSORS} is not valid safetensors: {e}"
        ) from e
    return unflatten(json.loads(files[layout.SNAPSHOT_STATE]), tensors)


# --- the global state and LATEST -----------------------------------------------------------------------


def agree_on_initial_weights(store: ObjectStore, weights_sha256: str) -> bool:
    """Record the digest of a fresh replica's initial weights, or compare with the one recorded first."""
    return store.create(layout.INITIAL_WEIGHTS, json.dumps({"sha256": weights_sha256}).encode())


def initial_weights(store: ObjectStore) -> str:
    """The digest of the initial weights recorded by ``agree_on_initial_weights``."""
    return str(json.loads(store.get(layout.INITIAL_WEIGHTS))["sha256"])


def write_global(
    store: ObjectStore, round_index: int, tree: Any, local: int = 0, key: RunKey | None = None
) -> int:
    """Write local rank ``local``'s part of the global state after ``round_index``; nothing points at it
    until ``advance``, once every part is written. Returns bytes written."""
    return write_snapshot(store, layout.global_state(round_index, local), tree, key)


def advance(store: ObjectStore, round_index: int, *, checkpoint: bool, keep: int = 2) -> None:
    """Point LATEST (and, for a checkpoint, CHECKPOINT) at the state of ``round_index``, every part of which
    is written; then drop older states, but the ``keep`` newest checkpoints: a resume starts from the newest,
    and from the one before when the newest is damaged."""
    latest.advance(store, round_index, checkpoint=checkpoint, keep=keep)
    keep_from, kept = latest.latest_round(store) - KEEP_STATES + 1, latest.kept_checkpoints(store)
    for name in store.list(layout.STATE):
        if name.isdigit() and int(name) < keep_from and int(name) not in kept:
            store.delete(f"{layout.STATE}/{name}")


def prune_exchanges(store: ObjectStore, round_index: int, *, keep_rollouts: int = KEEP_ROUNDS) -> None:
    """Drop the exchange objects and evaluation shares of rounds before the last ``KEEP_ROUNDS``, and the
    recorded rollouts before the last ``keep_rollouts``: a replica that is further behind catches up from a
    published state instead, and a harvest reads rollouts no older than that (a live harvest's lag)."""
    for prefix in (layout.ROUNDS, layout.EVALS):
        prune_numbered(store, prefix, keep_from=round_index - KEEP_ROUNDS + 1)
    prune_numbered(store, layout.ROLLOUTS, keep_from=round_index - keep_rollouts + 1)


def load_global(store: ObjectStore, round_index: int, local: int = 0, key: RunKey | None = None) -> Any:
    return read_snapshot(store, layout.global_state(round_index, local), key)


# --- per-replica state ---------------------------------------------------------------------------------


def save_replica(
    store: ObjectStore,
    rank: int,
    round_index: int,
    tree: Any,
    local: int = 0,
    *,
    prune: bool = True,
    key: RunKey | None = None,
) -> int:
    """Save local rank ``local`` of replica ``rank``: its own state after ``round_index``; with ``prune`` (one
    rank of the replica, once all have saved), drop the replica's states older than the oldest checkpoint
    kept, which no resume can need. Returns the bytes written."""
    written = write_snapshot(store, layout.replica_state(rank, round_index, local), tree, key)
    if prune:
        prune_replica(store, rank, round_index)
    return written


def prune_replica(store: ObjectStore, rank: int, round_index: int) -> None:
    kept = latest.kept_checkpoints(store)  # none readable: keep everything rather than guess
    keep_from = min(round_index, kept[-1]) if kept else 0
    prune_numbered(store, layout.replica_states(rank), keep_from=keep_from)


def load_replica(
    store: ObjectStore,
    rank: int,
    round_index: int,
    local: int = 0,
    agree: Callable[[bool], bool] = lambda readable: readable,
    key: RunKey | None = None,
) -> tuple[int, Any] | None:
    """Local rank ``local`` of replica ``rank``: its newest complete state at or before ``round_index``, as
    (round, state), or None. ``agree`` (whether this rank could read a round's state -> whether every rank of
    the replica could) keeps the ranks of one replica on the same round."""
    saved = sorted((int(n) for n in store.list(layout.replica_states(rank)) if n.isdigit()), reverse=True)
    for k in (k for k in saved if k <= round_index):
        state = None
        try:
            state = read_snapshot(store, layout.replica_state(rank, k, local), key)
        except FileNotFoundError:
            pass  # written partly when the replica died: its manifest is missing
        except CheckpointError as e:
            logger.warning("replica %d: skipping its unreadable state of round %d: %s", rank, k, e)
        if agree(state is not None):
            return k, state
    return None


def prune_numbered(store: ObjectStore, prefix: str, *, keep_from: int) -> None:
    """Delete the numbered entries under ``prefix`` before ``keep_from``."""
    for name in store.list(prefix):
        if name.isdigit() and int(name) < keep_from:
            store.delete(f"{prefix}/{name}")
