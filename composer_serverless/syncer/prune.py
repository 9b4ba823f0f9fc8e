"""What the syncer deletes from the store once a version is committed (``diloco.decoupled.keep_versions``).

Without it the store keeps every global version (an 8B model in fp32: 32 GB of parameters and 64 GB of outer
state per version) and every contribution. After each commit, and once at its start (a syncer killed between
a commit and its pruning leaves work that only a later listing finds), the syncer deletes:

* the snapshots (parameters, outer state) of versions older than the newest ``keep_versions``: learners and
  a restart read the newest, the one before covers a reader that listed it just before a commit, and a
  reader that finds its version gone moves to the newest (``decoupled.read_or_newer``);
* snapshots that no record names: those of a syncer that lost the creation of a record (or a sharded
  syncer's shard, of its part) or was killed before creating it. Only at versions the newest record already covers: a record is created once, so they can
  never be named; snapshots of the next version may be another syncer's merge in progress;
* contributions every kept version has consumed (with a sharded syncer, their fragments' objects too) (per learner, below the lowest of the kept records'
  ``consumed`` marks): a restarted syncer resumes from the newest kept version that reads whole (the
  rollback past a damaged version, ``decoupled.newest_intact``) and takes again what that version had not
  consumed, so those stay; a contribution not yet consumed is what a restarted syncer needs to redo a merge
  it had not committed, and stays too.

Every version's record stays (a few hundred bytes): it is what makes a version's creation once-only (a late
syncer cannot create a version again), and the run's history of what each merge took. A snapshot is
deleted manifest first, the reverse of its writing, so a half-deleted one reads as incomplete.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.decoupled import Version
from composer_serverless.rendezvous.store import ObjectStore

logger = logging.getLogger(__name__)


def stale_snapshots(
    names: list[str], newest: int, writers_of: Callable[[int], list[str]], keep: int
) -> list[str]:
    """The snapshot names (``{version:08d}-{writer}``, as under ``layout.GLOBALS``) to delete when version
    ``newest`` is committed: versions before the newest ``keep``, and at kept versions those not written by
    one of the version's record's writers (``writers_of``: its writer, or each fragment's). Versions after
    ``newest`` are left alone."""
    doomed = []
    for name in names:
        number, _, writer = name.partition("-")
        if not number.isdigit():
            continue
        v = int(number)
        if v <= newest - keep or (v <= newest and writer not in writers_of(v)):
            doomed.append(name)
    return doomed


def consumed_contributions(names: list[str], consumed: int) -> list[str]:
    """A learner's contribution names (its sequence numbers, and ``{seq}-{attempt}-{fragment}`` for a sharded
    syncer's fragments) below ``consumed``, its committed mark."""
    return [name for name in names if (seq := name.split("-", 1)[0]).isdigit() and int(seq) < consumed]


def prune(store: ObjectStore, record: Version, learners: int, keep: int | None) -> int:
    """Delete what committed version ``record`` makes unneeded (see the module); nothing when ``keep`` is
    None. Returns the number of snapshots and contributions deleted."""
    if keep is None:
        return 0
    records: dict[int, Version] = {record.version: record}

    def record_of(v: int) -> Version:
        if v not in records:
            records[v] = Version.from_json(store.get(layout.version(v)))
        return records[v]

    deleted = 0
    for prefix in (layout.GLOBALS, layout.SYNCER_STATES):
        for name in stale_snapshots(store.list(prefix), record.version, lambda v: record_of(v).writers, keep):
            store.delete(layout.snapshot_file(f"{prefix}/{name}", layout.SNAPSHOT_MANIFEST))
            store.delete(f"{prefix}/{name}")
            deleted += 1
    kept = [record_of(v) for v in range(max(0, record.version - keep + 1), record.version + 1)]
    for learner in range(learners):
        prefix = layout.contributions(learner)
        consumed = min(r.consumed.get(learner, 0) for r in kept)
        for name in consumed_contributions(store.list(prefix), consumed):
            store.delete(f"{prefix}/{name}")
            deleted += 1
    if deleted:
        logger.info("pruned %d snapshots and contributions after version %d", deleted, record.version)
    return deleted
