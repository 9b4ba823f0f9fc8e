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
  dropped, the grace window the syncer gave the learners missing from its quorum (``grace_s``) and how long
  it held each merged learner's contribution waiting for the last one (``held_s``) and the seconds per
  inner step of each (``step_s``; a record written before these fields existed has none, and a reader of
  that time ignores them). Whoever loses
  the creation of a record wrote its snapshots under its own name and discards them.
  It also names its ``parent``, the version whose global the merge stepped from: the one before it, but after
  a rollback (``newest_intact``) the newest intact one.
* With a **sharded syncer** (``diloco.decoupled.syncer_shards`` = F > 1) the global is cut into F fragments
  (``fragments.fragment_groups``: contiguous groups of whole tensors, named by version 0's record), and
  no syncer moves a whole contribution or a whole version. A learner writes one object per fragment of a
  contribution, under an attempt's name, then the contribution's own object: its header alone (no values),
  naming the attempt (``publish_parts``). Shard 0 decides what each merge takes and creates it once as the
  version's **plan**; every shard merges its fragment of that plan and writes its fragment's snapshots and a
  **part** record, created once; shard 0 creates the version's record, naming each part's writer
  (``parts``), once every part exists. So a version still exists only whole, and a learner reads it as F
  snapshots (``load_params``).

Version 0 is the initial weights, written by the first learner to start (all start from the same ones).
After each commit the syncer deletes old versions' snapshots and consumed contributions
(``syncer/prune.py``); a reader whose version went meanwhile takes the newest (``read_or_newer``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from composer_serverless.rendezvous import checkpoint, layout
from composer_serverless.rendezvous.codec import (
    NORM,
    NORM_SLACK,
    Codec,
    PayloadError,
    accumulate,
    decode,
    encode_parts,
    l2_norm,
    read_header,
)
from composer_serverless.rendezvous.latest import newest_version
from composer_serverless.rendezvous.rows import RowBlock
from composer_serverless.rendezvous.runkey import RunKey
from composer_serverless.rendezvous.store import ObjectStore

logger = logging.getLogger(__name__)

T = TypeVar("T")

_FIELDS = ("base", "tokens", "steps")
# An attempt's name in a contribution's header (``writer_token``'s form), checked before it names an object
_ATTEMPT = re.compile(r"[0-9a-f]{12}")


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
    # With a sharded syncer: the L2 norm of the whole contribution its header states (a shard sees one
    # fragment, and the outlier rule judges whole contributions alike in every shard); None without
    norm: float | None = None

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
    # With a sharded syncer: each fragment's parameter names, in the global's order (named by version 0's
    # writer, carried on); empty: one fragment, the whole global.
    fragments: list[list[str]] = field(default_factory=list)
    # With a sharded syncer: each fragment's snapshots' writer, in fragment order; empty: ``writer``'s hold the
    # whole global (version 0, and every version of an unsharded syncer).
    parts: list[str] = field(default_factory=list)
    # Per learner merged, how long the syncer held its contribution waiting for the merge's last one (seconds
    # between the polls that first saw each; 0 for the last): how far ahead of the others it publishes, which
    # it makes up by lengthening its round (diloco.decoupled.align).
    held_s: dict[int, float] = field(default_factory=dict)
    # Per learner merged, the seconds per inner step its newest contribution here took (its header's): how a
    # learner slower than the fastest paces its rounds (diloco.decoupled.dynamic_steps).
    step_s: dict[int, float] = field(default_factory=dict)

    @property
    def writers(self) -> list[str]:
        """Whose snapshots hold this version: each fragment's writer, or the one writer of the whole."""
        return self.parts or [self.writer]

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
            "fragments": self.fragments,
            "parts": self.parts,
            "held_s": {str(k): v for k, v in self.held_s.items()},
            "step_s": {str(k): v for k, v in self.step_s.items()},
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
            fragments=[[str(name) for name in group] for group in data.get("fragments", [])],
            parts=[str(writer) for writer in data.get("parts", [])],
            held_s={int(k): float(v) for k, v in data.get("held_s", {}).items()},
            step_s={int(k): float(v) for k, v in data.get("step_s", {}).items()},
        )


@dataclass(frozen=True)
class Plan:
    """What the merge of version ``version`` takes, as a sharded syncer's shard 0 decided it (created once,
    ``layout.version_plan``): per learner the sequence numbers it takes, the version the merge steps from
    (``parent``: after a rollback, not ``version - 1``), and the grace window given."""

    version: int
    parent: int
    taken: dict[int, list[int]]
    grace_s: float | None = None
    held_s: dict[int, float] = field(default_factory=dict)  # as ``Version.held_s``
    step_s: dict[int, float] = field(default_factory=dict)  # as ``Version.step_s``

    def to_json(self) -> bytes:
        record = {
            "version": self.version,
            "parent": self.parent,
            "taken": {str(k): v for k, v in self.taken.items()},
            "grace_s": self.grace_s,
            "held_s": {str(k): v for k, v in self.held_s.items()},
            "step_s": {str(k): v for k, v in self.step_s.items()},
        }
        return json.dumps(record).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Plan:
        data = json.loads(raw)
        return cls(
            version=int(data["version"]),
            parent=int(data["parent"]),
            taken={int(k): [int(s) for s in v] for k, v in data["taken"].items()},
            grace_s=None if data.get("grace_s") is None else float(data["grace_s"]),
            held_s={int(k): float(v) for k, v in data.get("held_s", {}).items()},
            step_s={int(k): float(v) for k, v in data.get("step_s", {}).items()},
        )


def _identity(run_id: str, learner: int, seq: int) -> dict[str, str]:
    return {"run": run_id, "kind": "contribution", "learner": str(learner), "seq": str(seq)}


def _part_identity(run_id: str, learner: int, seq: int, attempt: str, fragment: int) -> dict[str, str]:
    return {
        **_identity(run_id, learner, seq),
        "kind": "contribution-part",
        "attempt": attempt,
        "fragment": str(fragment),
    }


def _header(run_id: str, c: Contribution) -> dict[str, str]:
    """A contribution's header fields: its identity and what it covers."""
    identity = {**_identity(run_id, c.learner, c.seq), **{f: str(getattr(c, f)) for f in _FIELDS}}
    if c.seconds is not None:
        identity["seconds"] = repr(float(c.seconds))
    return identity


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
    parts = encode_parts(values, _header(run_id, c), codec, key, c.touched)
    if store.create(layout.contribution(c.learner, c.seq), parts):
        return sum(len(p) for p in parts)
    logger.info("contribution %d of learner %d exists from an earlier attempt", c.seq, c.learner)
    return 0


def publish_parts(
    store: ObjectStore,
    run_id: str,
    contribution: Contribution,
    fragments: list[tuple[torch.Tensor, torch.Tensor | None]],
    codec: Codec,
    key: RunKey | None,
) -> int:
    """A contribution for a sharded syncer: each fragment's values (and row bits) as an object of this
    attempt's, then the contribution's own object, its header with no values, naming the attempt; the bytes
    written (0 when an earlier attempt's contribution exists: it counts, and this one's parts are left for the
    syncer's pruning). ``contribution.touched`` is unused: each fragment carries its own rows' bits."""
    c = contribution
    if store.exists(layout.contribution(c.learner, c.seq)):
        logger.info("contribution %d of learner %d exists from an earlier attempt", c.seq, c.learner)
        return 0
    attempt = writer_token()
    sent = 0
    for fragment, (values, touched) in enumerate(fragments):
        identity = _part_identity(run_id, c.learner, c.seq, attempt, fragment)
        parts = encode_parts(values, identity, codec, key, touched)
        store.create(layout.contribution_part(c.learner, c.seq, attempt, fragment), parts)
        sent += sum(len(p) for p in parts)
    whole = math.sqrt(sum(l2_norm(values) ** 2 for values, _ in fragments))
    header = {**_header(run_id, c), "attempt": attempt, "fragments": str(len(fragments)), NORM: repr(whole)}
    parts = encode_parts(torch.zeros(0), header, codec, key)
    if store.create(layout.contribution(c.learner, c.seq), parts):
        return sent + sum(len(p) for p in parts)
    logger.info("contribution %d of learner %d was written by an earlier attempt meanwhile", c.seq, c.learner)
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
    fragment: int | None = None,
) -> tuple[Contribution, torch.Tensor]:
    """A contribution and its fp32 values, checked (identity, codec, size, checksum or MAC, finite); with
    ``rows``, it must carry exactly that many row bits, returned as its ``touched``. With ``fragment`` (a
    sharded syncer's shard) only that fragment's values (``numel`` of them) and rows, from the part of the
    attempt its header names (``publish_parts``).

    Raises:
        PayloadError: it may not be merged; FileNotFoundError: it is not in the store.
    """
    data = store.get(layout.contribution(learner, seq))
    identity = _identity(run_id, learner, seq)
    metadata = read_header(data)[0]["__metadata__"]
    assert isinstance(metadata, dict)
    values_of, expect, whole = data, identity, None
    if fragment is not None:
        decode(data, identity, codec, 0, key=key)  # the header's own checksum or MAC
        attempt = metadata.get("attempt", "")
        if not _ATTEMPT.fullmatch(attempt):
            raise PayloadError(
                f"contribution {seq} of learner {learner} names no attempt of its parts: {attempt!r}"
            )
        whole = _stated_norm(metadata)
        values_of = store.get(layout.contribution_part(learner, seq, attempt, fragment))
        expect = _part_identity(run_id, learner, seq, attempt, fragment)
    touched = None
    if rows:
        values = torch.zeros(numel, dtype=torch.float32)
        touched = accumulate(values, values_of, expect, codec, key=key, rows=rows)[1]
    else:
        values = decode(values_of, expect, codec, numel, key=key)
    if whole is not None and (norm := l2_norm(values)) > whole * NORM_SLACK and norm - whole > 1e-30:
        raise PayloadError(
            f"fragment {fragment} of contribution {seq} of learner {learner} has norm {norm:.4g}, more than the "
            f"norm {whole:.4g} its header states for the whole"
        )
    fields = {f: int(metadata[f]) for f in _FIELDS}
    seconds = float(metadata["seconds"]) if "seconds" in metadata else None
    return Contribution(learner, seq, **fields, seconds=seconds, touched=touched, norm=whole), values


def _stated_norm(metadata: dict[str, Any]) -> float:
    """The whole contribution's norm a sharded contribution's header states (``publish_parts``).

    Raises:
        PayloadError: it states none, or not a finite non-negative number.
    """
    try:
        whole = float(metadata[NORM])
    except (KeyError, ValueError):
        whole = math.nan
    if not (math.isfinite(whole) and whole >= 0):
        raise PayloadError(f"contribution states no usable norm of its whole: {metadata.get(NORM)!r}")
    return whole


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
    """Version ``record``'s global parameters by model name, each snapshot checked against its manifest (a
    sharded syncer's: every fragment's, in order)."""
    params: dict[str, torch.Tensor] = {}
    for writer in record.writers:
        params.update(checkpoint.read_snapshot(store, layout.global_params(record.version, writer), key))
    return params


def load_part(
    store: ObjectStore, record: Version, fragment: int, key: RunKey | None
) -> dict[str, torch.Tensor]:
    """Fragment ``fragment``'s parameters of version ``record`` (a sharded syncer's shard reads its own), or of
    a shard's part record, whose one snapshot holds just that fragment."""
    if not record.parts:  # one snapshot: the whole (version 0), or a part's fragment
        params = load_params(store, record, key)
        return {name: params[name] for name in record.fragments[fragment]}
    return checkpoint.read_snapshot(store, layout.global_params(record.version, record.parts[fragment]), key)


def load_outer(store: ObjectStore, record: Version, key: RunKey | None, fragment: int = 0) -> dict[str, Any]:
    """The syncer's outer optimizer state after version ``record`` (a sharded syncer's: fragment
    ``fragment``'s shard's)."""
    writer = record.writers[fragment]
    return checkpoint.read_snapshot(store, layout.syncer_state(record.version, writer), key)


def newest_intact(
    store: ObjectStore, newest: int, key: RunKey | None, *, outer: bool, fragment: int | None = None
) -> tuple[Version, dict[str, torch.Tensor], dict[str, Any] | None]:
    """The newest version at or below ``newest`` that reads whole, loaded: its record, its parameters and,
    with ``outer`` (a syncer), the outer optimizer state after it (None for version 0, which has none). A
    sharded syncer's shard (``fragment``) loads its fragment's alone, so no shard ever holds the whole global;
    shard 0 reads every other fragment too, one at a time, to check it (the rollback past a damaged version is
    its decision, which its plans carry to the other shards).

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
            if fragment is None:
                params = load_params(store, record, key)
            else:
                params = load_part(store, record, fragment, key)
                for other in range(len(record.parts)) if fragment == 0 else ():
                    if other != fragment:
                        load_part(store, record, other, key)  # checked, then dropped
            state = load_outer(store, record, key, fragment or 0) if outer and v > 0 else None
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


def commit_fragments(
    store: ObjectStore, record: Version, params: dict[str, torch.Tensor], key: RunKey | None
) -> bool:
    """Version ``record`` (the initial weights, with no outer state) written as one snapshot per fragment of
    ``record.fragments``, each under a writer name of its own, then its record naming them: so a sharded
    syncer's shard reads its own fragment of every version, this one included. False when another writer
    created the version first."""
    parts = []
    for names in record.fragments:
        part = dataclasses.replace(record, writer=writer_token())
        _write(store, part, {name: params[name] for name in names}, None, key)
        parts.append(part.writer)
    whole = dataclasses.replace(record, writer=parts[0], parts=parts)
    return store.create(layout.version(record.version), whole.to_json())


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
    _write(store, record, params, outer, key)
    return store.create(layout.version(v), record.to_json())


def _write(
    store: ObjectStore,
    record: Version,
    params: dict[str, torch.Tensor],
    outer: dict[str, Any] | None,
    key: RunKey | None,
) -> None:
    checkpoint.write_snapshot(store, layout.global_params(record.version, record.writer), params, key)
    if outer is not None:
        checkpoint.write_snapshot(store, layout.syncer_state(record.version, record.writer), outer, key)


def commit_part(
    store: ObjectStore,
    part: Version,
    fragment: int,
    params: dict[str, torch.Tensor],
    outer: dict[str, Any],
    key: RunKey | None,
) -> bool:
    """A sharded syncer's shard: write its fragment's snapshots of version ``part.version`` under its writer's
    name, then create the part's record; False (nothing of it counts) when another writer created it first."""
    _write(store, part, params, outer, key)
    return store.create(layout.version_part(part.version, fragment), part.to_json())


def read_part(store: ObjectStore, v: int, fragment: int) -> Version | None:
    """Fragment ``fragment``'s part record of version ``v``, None before it exists."""
    try:
        return Version.from_json(store.get(layout.version_part(v, fragment)))
    except FileNotFoundError:
        return None


def create_plan(store: ObjectStore, plan: Plan) -> Plan:
    """Create version ``plan.version``'s plan once; the plan that counts (another shard 0's, if it won)."""
    if store.create(layout.version_plan(plan.version), plan.to_json()):
        return plan
    logger.info("version %d's plan exists (another syncer's): merging that one", plan.version)
    return Plan.from_json(store.get(layout.version_plan(plan.version)))


def read_plan(store: ObjectStore, v: int) -> Plan | None:
    """Version ``v``'s plan, None before shard 0 creates it."""
    try:
        return Plan.from_json(store.get(layout.version_plan(v)))
    except FileNotFoundError:
        return None
