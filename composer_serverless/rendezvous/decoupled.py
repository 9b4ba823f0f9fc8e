"""What decoupled mode's learners and syncer share through the store: contributions, and global versions.

* A **contribution** is one learner's pseudo-gradient (its progress not sent yet: the parameters of its
  last contribution or adoption minus its local parameters, one flat tensor in the global's parameter
  order) through the run's codec, with its checksum or, with a run key, its MAC. Its header names the run,
  the learner, its sequence number, the global version it holds (``base``), the tokens and inner steps
  it covers and the seconds those steps took (``seconds``, which the syncer's grace window reads; a header
  written before the field existed has none: unknown). Created once under
  ``layout.contribution(learner, seq)``: an input is immutable once written, as in lock-step's exchange.
* A **global version** ``v`` is two snapshots (``checkpoint.write_snapshot``: manifest last, checksums or
  MACs): the parameters, which learners load, and the syncer's outer optimizer state, which only a syncer
  loads; then the record ``layout.version(v)``, created once. The record names the snapshots' writer and
  says what the merge took: ``consumed`` (per learner, the next sequence number not yet taken, so a
  contribution is merged at most once whichever syncer resumes), which contributions it merged or
  dropped, and the grace window the syncer gave the learners missing from its quorum (``grace_s``; a
  record written before the field existed has none, and a reader of that time ignores it). Whoever loses
  the creation of a record wrote its snapshots under its own name and discards them.
  It also names its ``parent``, the version whose global the merge stepped from: the one before it, but after
  a rollback (``newest_intact``) the newest intact one.

Version 0 is the initial weights, written by the first learner to start (all start from the same ones).
After each commit the syncer deletes old versions' snapshots and consumed contributions
(``syncer/prune.py``); a reader whose version went meanwhile takes the newest (``read_or_newer``).
"""

from __future__ import annotations

import json
import logging
import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from composer_serverless.rendezvous import checkpoint, layout
from composer_serverless.rendezvous.codec import Codec, accumulate, decode, encode_parts, read_header
from composer_serverless.rendezvous.latest import newest_version
from composer_serverless.rendezvous.rows import RowBlock
from composer_serverless.rendezvous.runkey import RunKey
from composer_serverless.rendezvous.store import ObjectStore

logger = logging.getLogger(__name__)

T = TypeVar("T")

_FIELDS = ("base", "tokens", "steps")


def writer_token() -> str:
    """A name for one process's writes of versions, unique across processes and restarts."""
    return secrets.token_hex(6)


@dataclass(frozen=True)
class Contribution:
    """A contribution's identity and what it covers."""

    learner: int
    seq: int
    base: int  # the global version the learner started from
    tokens: int
    steps: int
    seconds: float | None = None  # the time its inner steps took (None: a header written before the field)
    # With diloco.embedding_average = "touched": the row bits it carries (``rows.RowMask.bits`` over
    # ``row_blocks``), which rows its learner's data held in which step buckets; None without
    touched: torch.Tensor | None = field(default=None, compare=False, repr=False)

    @property
    def step_s(self) -> float | None:
        """Seconds per inner step, when known (a header's time that is not a finite non-negative number counts
        as unknown: it cannot be a measure)."""
        seconds = self.seconds
        if seconds is None or not math.isfinite(seconds) or seconds < 0 or self.steps <= 0:
            return None
        return seconds / self.steps


@dataclass(frozen=True)
class Version:
    """A global version's record (``layout.version``)."""

    version: int
    writer: str
    consumed: dict[int, int] = field(default_factory=dict)
    merged: list[list[int]] = field(default_factory=list)  # [learner, seq] pairs averaged into it
    dropped: list[dict[str, Any]] = field(default_factory=list)  # {learner, seq, why}
    # The embeddings' parameter names (input, and an untied output head), which a merge averages plainly:
    # named by the learner that writes version 0, which knows the model, and carried on by every version.
    embeddings: list[str] = field(default_factory=list)
    # The version whose global this one's merge stepped from (-1: none, version 0): ``version - 1``, or after
    # a rollback past damaged versions the newest intact one (what those took is taken again, by this one).
    parent: int = -1
    # The grace window, in seconds, the syncer gave the learners missing from its quorum once that was in (it
    # merged sooner if they all came; None: it gave none, every learner's was in at once, or it waited for all).
    grace_s: float | None = None
    # With diloco.embedding_average = "touched": the parameters with a row per token whose rows contributions
    # carry bits for (``row_blocks``), in the global's order; named by version 0's writer, carried on.
    token_rows: list[str] = field(default_factory=list)

    def to_json(self) -> bytes:
        record = {
            "version": self.version,
            "writer": self.writer,
            "consumed": {str(k): v for k, v in self.consumed.items()},
            "merged": self.merged,
            "dropped": self.dropped,
            "embeddings": self.embeddings,
            "parent": self.parent,
            "grace_s": self.grace_s,
            "token_rows": self.token_rows,
        }
        return json.dumps(record).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Version:
        data = json.loads(raw)
        return cls(
            version=int(data["version"]),
            writer=str(data["writer"]),
            consumed={int(k): int(v) for k, v in data["consumed"].items()},
            merged=[[int(a), int(b)] for a, b in data["merged"]],
            dropped=list(data["dropped"]),
            embeddings=[str(name) for name in data["embeddings"]],
            parent=int(data.get("parent", int(data["version"]) - 1)),
            grace_s=None if data.get("grace_s") is None else float(data["grace_s"]),
            token_rows=[str(name) for name in data.get("token_rows", [])],
        )


def _identity(run_id: str, learner: int, seq: int) -> dict[str, str]:
    return {"run": run_id, "kind": "contribution", "learner": str(learner), "seq": str(seq)}


def row_blocks(shapes: dict[str, tuple[int, ...]], token_rows: list[str]) -> tuple[RowBlock, ...]:
    """The token-indexed blocks of a contribution's flat values (its tensors of ``shapes`` in order, whole):
    the tensors named in ``token_rows`` (a version record's), a row per token. The learner marks its rows'
    bits and the syncer combines them over this same layout."""
    blocks, offset = [], 0
    for name, shape in shapes.items():
        if name in token_rows:
            blocks.append(RowBlock(offset=offset, rows=shape[0], width=math.prod(shape[1:])))
        offset += math.prod(shape)
    return tuple(blocks)


def publish(
    store: ObjectStore,
    run_id: str,
    contribution: Contribution,
    values: torch.Tensor,
    codec: Codec,
    key: RunKey | None,
) -> int:
    """Create the contribution's object, with its row bits if it has them (``touched``); the bytes written
    (0 when an earlier attempt of this learner already wrote it: inputs are immutable, the stored one
    counts)."""
    c = contribution
    identity = {**_identity(run_id, c.learner, c.seq), **{f: str(getattr(c, f)) for f in _FIELDS}}
    if c.seconds is not None:
        identity["seconds"] = repr(float(c.seconds))
    parts = encode_parts(values, identity, codec, key, c.touched)
    if store.create(layout.contribution(c.learner, c.seq), parts):
        return sum(len(p) for p in parts)
    logger.info("contribution %d of learner %d exists from an earlier attempt", c.seq, c.learner)
    return 0


def waiting(store: ObjectStore, learners: int, consumed: dict[int, int]) -> dict[int, list[int]]:
    """Per learner, the sequence numbers of its contributions in the store not yet consumed, in order."""
    out: dict[int, list[int]] = {}
    for learner in range(learners):
        seqs = sorted(int(n) for n in store.list(layout.contributions(learner)) if n.isdigit())
        left = [s for s in seqs if s >= consumed.get(learner, 0)]
        if left:
            out[learner] = left
    return out


def read_contribution(
    store: ObjectStore,
    run_id: str,
    learner: int,
    seq: int,
    codec: Codec,
    numel: int,
    key: RunKey | None,
    rows: int = 0,
) -> tuple[Contribution, torch.Tensor]:
    """A contribution and its fp32 values, checked (identity, codec, size, checksum or MAC, finite); with
    ``rows``, it must carry exactly that many row bits, returned as its ``touched``.

    Raises:
        PayloadError: it may not be merged; FileNotFoundError: it is not in the store.
    """
    data = store.get(layout.contribution(learner, seq))
    identity = _identity(run_id, learner, seq)
    touched = None
    if rows:
        values = torch.zeros(numel, dtype=torch.float32)
        touched = accumulate(values, data, identity, codec, key=key, rows=rows)[1]
    else:
        values = decode(data, identity, codec, numel, key=key)
    metadata = read_header(data)[0]["__metadata__"]
    assert isinstance(metadata, dict)
    fields = {f: int(metadata[f]) for f in _FIELDS}
    seconds = float(metadata["seconds"]) if "seconds" in metadata else None
    return Contribution(learner, seq, **fields, seconds=seconds, touched=touched), values


def read_version(store: ObjectStore, v: int) -> Version:
    return Version.from_json(store.get(layout.version(v)))


def read_or_newer(store: ObjectStore, record: Version, read: Callable[[Version], T]) -> tuple[Version, T]:
    """``read(record)``, or, when version ``record`` was pruned before or while it was read (the syncer keeps
    the newest ``diloco.decoupled.keep_versions``), the newest version's record and ``read`` of it; as
    lock-step's replicas move to the newer state when theirs was pruned meanwhile.

    Raises:
        FileNotFoundError, CheckpointError: ``record``'s snapshots cannot be read and no newer version exists
            (a damaged version, not a pruned one).
    """
    while True:
        try:
            return record, read(record)
        except (FileNotFoundError, checkpoint.CheckpointError) as e:
            newest = newest_version(store)
            if newest <= record.version:
                raise
            logger.info("global version %d is gone (%s): taking the newest, %d", record.version, e, newest)
            record = read_version(store, newest)


def load_params(store: ObjectStore, record: Version, key: RunKey | None) -> dict[str, torch.Tensor]:
    """Version ``record``'s global parameters by model name, checked against their manifest."""
    return checkpoint.read_snapshot(store, layout.global_params(record.version, record.writer), key)


def load_outer(store: ObjectStore, record: Version, key: RunKey | None) -> dict[str, Any]:
    """The syncer's outer optimizer state after version ``record``."""
    return checkpoint.read_snapshot(store, layout.syncer_state(record.version, record.writer), key)


def newest_intact(
    store: ObjectStore, newest: int, key: RunKey | None, *, outer: bool
) -> tuple[Version, dict[str, torch.Tensor], dict[str, Any] | None]:
    """The newest version at or below ``newest`` that reads whole, loaded: its record, its parameters and,
    with ``outer`` (a syncer), the outer optimizer state after it (None for version 0, which has none).

    ``commit`` creates a record only after its snapshots are whole, so a version that does not read was
    damaged afterwards (an object corrupted, replaced, or written without the run's key): as lock-step's
    rollback passes over a damaged checkpoint for the one before it, each damaged version is passed over,
    with a warning, for the one before it. The syncer prunes all but the newest
    ``diloco.decoupled.keep_versions`` (``syncer/prune.py``), so the walk reaches back that far at most, and
    a version that does not read while a newer one has been committed meanwhile may just have been pruned:
    the walk starts again from the newest.

    Raises:
        CheckpointError: no version at or below ``newest`` reads whole, each named with why.
    """
    problems = []
    v = newest
    while v >= 0:
        try:
            record = read_version(store, v)
            params = load_params(store, record, key)
            state = load_outer(store, record, key) if outer and v > 0 else None
        except (checkpoint.CheckpointError, FileNotFoundError, ValueError, KeyError, TypeError) as e:
            now = newest_version(store)
            if now > newest:  # committed meanwhile: version v may have been pruned while it was read
                logger.info("global version %d is gone (%s): taking the newest, %d", v, e, now)
                v = newest = now
                continue
            logger.warning("global version %d cannot be read, passing it over: %s", v, e)
            problems.append(f"version {v}: {e}")
            v -= 1
            continue
        return record, params, state
    raise checkpoint.CheckpointError(f"no global version in {store.url} can be read: " + "; ".join(problems))


def commit(
    store: ObjectStore,
    record: Version,
    params: dict[str, torch.Tensor],
    outer: dict[str, Any] | None,
    key: RunKey | None,
) -> bool:
    """Write ``record``'s snapshots under its writer's name, then create its record; False (nothing of it
    counts) when another writer created version ``record.version`` first."""
    v = record.version
    checkpoint.write_snapshot(store, layout.global_params(v, record.writer), params, key)
    if outer is not None:
        checkpoint.write_snapshot(store, layout.syncer_state(v, record.writer), outer, key)
    return store.create(layout.version(v), record.to_json())
