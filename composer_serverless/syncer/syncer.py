"""The syncer: a CPU process that turns the learners' contributions into global versions, one merge at a time.

Each merge: wait until contributions from ``diloco.decoupled.min_quorum`` learners are in the store (every
learner by default), then a grace window for the others (at once when every learner's is in): with
``grace_gamma``, the share of the slack the learners' overlap hides (``merge.grace_window``: wait only as long
as the learners' next inner steps hide), bounded by ``grace_s``; without, ``grace_s`` itself; take
every contribution not yet consumed; drop those that fail their checks (checksum, MAC, identity, finite), whose
base version is more than ``max_age`` behind, or whose norm is an outlier (``robust.outliers``, as lock-step's
exchange); weigh the rest (``merge.contribution_weight``) and merge them tensor by tensor (``merge.py``: with
equal weights, lock-step's arithmetic), and step the outer optimizer (``outer.py``: lock-step's Nesterov SGD,
or Delayed Nesterov) on its CPU copy of the global; then commit
the new version (``rendezvous/decoupled.py``): parameters, outer state, and the record of what it consumed
(and how long it held each learner's contribution waiting for the last one it took, ``held_s``, which a
learner that came early makes up by lengthening its round: ``replicas/decoupled.py``, ``_align``; and each
one's seconds per inner step, ``step_s``, by which a slower learner paces its rounds: ``_pace``).

Nothing lost, nothing merged twice, whatever kills it: a syncer starts from the newest committed version and
its recorded ``consumed`` marks; contributions are immutable; a version is committed by creating its record,
once. Two syncers at once (a restart while the old one still runs) cannot both commit a version: the loser
of the creation reloads the winner's and goes on from there. A version damaged after its commit (it no longer
reads whole) is passed over by a restarted syncer for the newest intact one, whose marks make the
contributions the damaged ones took unconsumed again: the next version merges them, and names the intact
one as its ``parent``. After each commit it deletes what no one needs any more (``prune.py``: old versions'
snapshots, contributions every kept version consumed), never what a redo of an uncommitted merge or a
rollback to a kept version takes.

**Sharded** (``diloco.decoupled.syncer_shards`` = F > 1; ``rendezvous/decoupled.py``): F syncer processes,
shard k holding fragment k of the global (its tensors, and the outer state over them) and reading only
fragment k of each contribution. Shard 0 waits for the quorum and the grace window as above and creates the
version's plan, once (a restarted shard 0 finds it and merges that, never a second choice); every shard
merges its fragment of the plan, tensor by tensor as the whole syncer does (so F shards end on the unsharded
syncer's global bit for bit), and creates its part, once (a restarted shard finds its part and takes up from
it); shard 0 creates the version's record once every part exists, then prunes. The outlier rule judges the
whole contributions' norms their headers state (a fragment larger than its stated whole is refused), so
every shard leaves out the same ones; a fragment that fails its own checks (checksum, MAC, finite) is
dropped by its shard alone, recorded with its fragment, and merged wherever it passed.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import torch

from composer_serverless.config import RunConfig
from composer_serverless.rendezvous import decoupled as versions
from composer_serverless.rendezvous import layout, runkey
from composer_serverless.rendezvous.codec import Codec, PayloadError, decode, encode, l2_norm
from composer_serverless.rendezvous.decoupled import Contribution, Plan, Version
from composer_serverless.rendezvous.latest import newest_version
from composer_serverless.rendezvous.robust import outliers
from composer_serverless.rendezvous.rows import RowSums, Span, bucket_count, span_rows, spans
from composer_serverless.rendezvous.runkey import RunKey
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import Reporter
from composer_serverless.syncer.merge import contribution_weight, grace_window, merge_tensors
from composer_serverless.syncer.outer import DelayedNesterov, outer_optimizer
from composer_serverless.syncer.prune import prune

logger = logging.getLogger(__name__)

T = TypeVar("T")


def run_syncer(run: ObjectStore, shard: int = 0) -> None:
    """Merge (fragment ``shard`` of) the run at ``run`` until its last global version (``diloco.rounds``)
    is committed, beating as its rank after the learners' (``DiLoCoConfig.syncer_ranks``), as a replica
    beats."""
    config = RunConfig.model_validate_json(run.get(layout.RUN_CONFIG))
    ranks = config.diloco.syncer_ranks
    if not ranks:
        raise ValueError(f"{run.url} runs diloco.mode = {config.diloco.mode!r}: it has no syncer")
    if not 0 <= shard < len(ranks):
        raise ValueError(f"{run.url} has {len(ranks)} syncer shards: there is no shard {shard}")
    rank = ranks[shard]
    run.tolerate_outages(config.diloco.store_outage_s)
    reporter = Reporter(run, rank)
    reporter.beat(state="starting")
    try:
        key = runkey.run_key(config.diloco)
        if key is not None:
            runkey.check_fingerprint(run, key)
            key = key.for_run(config.run_id or "")
        Syncer(run, config, key, reporter, shard=shard).run()
    except BaseException as e:
        reporter.beat(state="failed", error=f"{type(e).__name__}: {e}")
        raise


class Gathered(NamedTuple):
    """What a merge takes: per learner, its unconsumed contributions' sequence numbers; and the grace window
    the syncer gave the learners missing from its quorum (None: it gave none: every learner's was in at
    once, or it waited for every learner)."""

    taken: dict[int, list[int]]
    grace_s: float | None = None
    held_s: dict[int, float] = {}  # per learner taken, how long its contribution waited for the last one's
    step_s: dict[int, float] = {}  # per learner taken, the seconds per inner step of its newest contribution


class Syncer:
    """One syncer process's merges (see the module); with a sharded syncer, shard ``shard``'s. ``clock`` and
    ``sleep`` are its time: the grace window is measured and waited with them (a test drives them instead of
    the wall clock)."""

    def __init__(
        self,
        run: ObjectStore,
        config: RunConfig,
        key: RunKey | None,
        reporter: Reporter,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        shard: int = 0,
    ) -> None:
        dl = config.diloco
        self.shard, self.shards = shard, dl.decoupled.syncer_shards
        self.clock, self.sleep = clock, sleep
        self.reporter = reporter
        self.run_store = run
        self.config = config
        self.key = key
        self.learners = dl.replicas
        self.quorum = dl.decoupled.min_quorum or dl.replicas
        self.codec: Codec = dl.codec  # type: ignore[assignment]  # the sparse codec is refused (config)
        self.reduced: Codec = dl.reduced_codec or dl.codec  # type: ignore[assignment]
        self.writer = versions.writer_token()
        self.params: dict[str, torch.Tensor] = {}
        self.outer: torch.optim.Optimizer | None = None
        self.record = Version(-1, "")  # the version whose global it holds, and what that one's merge took
        self.newest = -1  # the newest version committed: the record's, unless damaged ones were passed over
        self.sync_s = 0.0  # its last merge's time, from reading the contributions to the commit (0: none yet)
        # Contributions the grace window's estimate read, kept for the merge that takes them (read once)
        self.read: dict[tuple[int, int], tuple[Contribution, torch.Tensor]] = {}
        # With embedding_average = "touched": the embedding rows' spans of the flat values, and the row bits
        # each contribution carries for them (none otherwise)
        self.row_spans: list[Span] = []
        self.row_bits = 0

    def run(self) -> None:
        self._load(self._first_version())
        if self.shard == 0:
            self._prune()  # what a predecessor killed between its commit and its pruning left
        while self.newest < self.config.diloco.rounds:
            if self.shards == 1:
                self._merge(self._gather())
            elif self.shard == 0:
                self._merge_plan(self._plan())
            else:
                self._merge_part(self._wait_for(lambda: versions.read_plan(self.run_store, self.newest + 1)))
        logger.info("the run's last global version (%d) is merged: done", self.newest)
        self._beat("done")

    def _beat(self, state: str) -> None:
        rounds = self.config.diloco.rounds
        self.reporter.beat(state=state, round=max(self.newest, 0), rounds=rounds, step=0, steps=1)

    def _poll_s(self) -> float:
        """Seconds between its listings (``DecoupledConfig.poll_every``): unset, a hundredth of a round at
        the median step time of the contributions its newest version merged."""
        dl = self.config.diloco
        known = list(self.record.step_s.values())
        return dl.decoupled.poll_every(dl.sync_every, statistics.median(known) if known else None)

    def _prune(self) -> None:
        prune(self.run_store, self.record, self.learners, self.config.diloco.decoupled.keep_versions)

    def _first_version(self) -> int:
        """The newest committed version, once version 0 (the learners' initial weights) exists."""
        told = False
        self._beat("waiting")
        while (newest := newest_version(self.run_store)) < 0:
            if not told:
                logger.info("waiting for a learner to write global version 0 (the initial weights)")
                told = True
            self.sleep(self._poll_s())
        return newest

    def _load(self, v: int) -> None:
        """Continue after committed version ``v`` from the newest intact version at or below it
        (``versions.newest_intact``, which takes a newer one if ``v`` was pruned meanwhile): its parameters,
        the outer state after it, its marks. The next version is ``v + 1`` either way; after a rollback past damaged versions, the contributions they took are
        unconsumed again by the intact one's marks, so the next merge takes them again, once."""
        if self.shards > 1 and len(cut := versions.read_version(self.run_store, v).fragments) != self.shards:
            raise ValueError(
                f"diloco.decoupled.syncer_shards is {self.shards} but version {v} is cut into "
                f"{len(cut) or 1} fragments: a run keeps the shards its version 0 was written for"
            )
        fragment = self.shard if self.shards > 1 else None
        record, params, outer = versions.newest_intact(
            self.run_store, v, self.key, outer=True, fragment=fragment
        )
        self._hold(record, params, outer)
        v = max(v, record.version)  # newer, if version v was pruned while it was read (another syncer's)
        self.newest = v
        if record.version < v:
            logger.warning(
                "rolled back: versions %d-%d cannot be read; continuing from version %d's global and its marks "
                "(consumed %s), so version %d merges again what they merged",
                record.version + 1,
                v,
                record.version,
                record.consumed,
                v + 1,
            )
        else:
            logger.info("holding global version %d (consumed %s)", v, record.consumed)

    def _hold(self, record: Version, params: dict[str, torch.Tensor], outer: dict[str, Any] | None) -> None:
        """Hold ``record``'s global (this shard's fragment of it) and the outer state after it."""
        dl = self.config.diloco
        self.params = params
        self.outer = outer_optimizer(
            list(self.params.values()),
            lr=dl.outer_lr,
            momentum=dl.outer_momentum,
            nesterov=dl.nesterov,
            delay=dl.replicas if dl.decoupled.outer == "delayed_nesterov" else 1,
        )
        if outer is not None:
            self.outer.load_state_dict(outer)
        if dl.embedding_average == "touched":
            shapes = {name: tuple(t.shape) for name, t in self.params.items()}
            numel = sum(t.numel() for t in self.params.values())
            self.row_spans = spans(versions.row_blocks(shapes, record.token_rows), 0, numel)
            self.row_bits = span_rows(self.row_spans) * bucket_count(dl.sync_every)
        self.record = record

    def _gather(self) -> Gathered:
        """Per learner, its unconsumed contributions, once the quorum and the grace window allow a merge."""
        # (learner, newest seq) -> the poll that first saw it (at once for one that came during the previous
        # merge). The first one's learner has trained on since it published: that overlap, not the time since
        # this wait began (spent with nothing to merge), is what the quorum and the window use up.
        seen: dict[tuple[int, int], float] = {}
        grace: float | None = None  # once the quorum is in (math.inf: wait for every learner)
        deadline = math.inf
        self._beat("waiting")
        while True:
            waiting = versions.waiting(self.run_store, self.learners, self.record.consumed)
            now = self.clock()
            for learner, seqs in waiting.items():
                seen.setdefault((learner, max(seqs)), now)
            if len(waiting) == self.learners:
                return self._gathered(
                    waiting, grace if grace is not None and math.isfinite(grace) else None, seen
                )
            if seen and len(waiting) >= self.quorum:  # a quorum is at least one learner
                if grace is None:  # the quorum is in: the window starts
                    grace = self._grace(waiting, quorum_s=now - min(seen.values()))
                    deadline = now + grace
                if now >= deadline:
                    return self._gathered(waiting, grace, seen)
            self.sleep(self._poll_s())

    def _gathered(
        self, waiting: dict[int, list[int]], grace: float | None, seen: dict[tuple[int, int], float]
    ) -> Gathered:
        """What the merge takes, with how long each learner's newest contribution in it waited for the last
        one seen (``Version.held_s``: a learner ahead of the others lengthens its round by that much) and the
        seconds per inner step of each (``Version.step_s``: a slower learner shortens its rounds by it)."""
        arrived = {learner: seen[(learner, max(seqs))] for learner, seqs in waiting.items()}
        last = max(arrived.values())
        self._read_in_hand(waiting)
        step_s = {
            learner: s
            for (learner, seq), (c, _) in sorted(self.read.items())  # each learner's newest last
            if seq in waiting.get(learner, []) and (s := c.step_s) is not None
        }
        held = {learner: last - t for learner, t in sorted(arrived.items())}
        return Gathered(waiting, grace, held, step_s)

    def _grace(self, waiting: dict[int, list[int]], quorum_s: float) -> float:
        """How long to wait for the learners missing from the quorum (``math.inf``: for every one of them):
        ``grace_s``, or with ``grace_gamma`` the adaptive window (``merge.grace_window``) from the median seconds
        per step of the contributions in hand, ``quorum_s`` (from the first contribution in hand to the
        quorum) and this syncer's last merge's time. Without a known step time (headers written before they
        carried one) the fixed rule."""
        dl = self.config.diloco
        dc = dl.decoupled
        bound = math.inf if dc.grace_s is None else dc.grace_s
        missing = sorted(set(range(self.learners)) - set(waiting))
        if dc.grace_gamma is None:
            logger.info("quorum in after %.2fs: waiting up to %s s for learners %s", quorum_s, bound, missing)
            return bound
        step_s = self._step_s(waiting)
        if step_s is None:
            logger.info("no contribution in hand says its step time: waiting up to %s s (grace_s)", bound)
            return bound
        tau = dl.sync_every if dc.max_lag >= 1 else 0  # with max_lag 0 the learners wait: nothing hidden
        grace = grace_window(
            tau=tau, step_s=step_s, quorum_s=quorum_s, sync_s=self.sync_s, gamma=dc.grace_gamma, bound_s=bound
        )
        logger.info(
            "quorum in after %.2fs: waiting %.2fs for learners %s (%s x (%d steps x %.3fs - %.2fs - last merge "
            "%.2fs), at most %s s)",
            quorum_s,
            grace,
            missing,
            dc.grace_gamma,
            tau,
            step_s,
            quorum_s,
            self.sync_s,
            bound,
        )
        return grace

    def _read_in_hand(self, waiting: dict[int, list[int]]) -> None:
        """Read the contributions in hand not read yet, once: the merge takes them from memory."""
        for learner, seqs in waiting.items():
            for seq in seqs:
                if (learner, seq) not in self.read:
                    try:
                        self.read[(learner, seq)] = self._read(learner, seq)
                    except (PayloadError, FileNotFoundError, ValueError):
                        continue  # the merge reads it again and drops it, saying why

    def _step_s(self, waiting: dict[int, list[int]]) -> float | None:
        """The median seconds per inner step of the contributions in hand, None if none says."""
        self._read_in_hand(waiting)
        known = [s for c, _ in self.read.values() if (s := c.step_s) is not None]
        return statistics.median(known) if known else None

    def _combine(
        self, taken: dict[int, list[int]], v: int
    ) -> tuple[list[list[int]], list[dict[str, Any]], list[int]]:
        """Merge the contributions ``taken`` into the global this syncer holds (version ``v``'s, or after a
        rollback its newest intact one's): check, weigh and combine them and step the outer optimizer. Returns
        what it merged ([learner, seq] pairs), what it dropped and why, and the merged ones' staleness."""
        read, self.read = self.read, {}
        dl = self.config.diloco
        dc = dl.decoupled
        good: dict[tuple[int, int], tuple[Contribution, torch.Tensor]] = {}
        weights: list[float] = []
        dropped: list[dict[str, Any]] = []
        for learner, seqs in sorted(taken.items()):
            for seq in seqs:
                try:
                    c, values = read.get((learner, seq)) or self._read(learner, seq)
                    weight = contribution_weight(
                        tokens=c.tokens,
                        steps=c.steps,
                        age=v - c.base,
                        weighting=dc.weighting,
                        max_age=dc.max_age,
                        discount=dc.discount,
                    )
                except (PayloadError, FileNotFoundError, ValueError) as e:
                    dropped.append({"learner": learner, "seq": seq, "why": str(e)})
                    continue
                if weight is None:
                    why = f"started from version {c.base}, {v - c.base} behind (max_age {dc.max_age})"
                    dropped.append({"learner": learner, "seq": seq, "why": why})
                    continue
                good[(learner, seq)] = (c, values)
                weights.append(weight)
        index = {ids: i for i, ids in enumerate(good)}
        # a shard judges the whole contributions' norms their headers state, so every shard drops the same ones
        norms = {
            index[ids]: c.norm if c.norm is not None else l2_norm(values) for ids, (c, values) in good.items()
        }
        left_out = outliers(norms, dl.outlier_norm_factor, len(good))
        for i, why in left_out.items():
            ids = next(ids for ids, j in index.items() if j == i)
            dropped.append({"learner": ids[0], "seq": ids[1], "why": why})
            del good[ids]
        weights = [w for i, w in enumerate(weights) if i not in left_out]
        if self.shards > 1:
            dropped = [{**d, "fragment": self.shard} for d in dropped]
        for d in dropped:
            logger.warning("dropped contribution %d of learner %d: %s", d["seq"], d["learner"], d["why"])
        if good:
            average = self._merged([values for _, values in good.values()], weights)
            if self.row_spans:
                self._touched_rows(average, list(good.values()))
            self._outer_step(average, len(good))
        return [[learner, seq] for learner, seq in good], dropped, [v - c.base for c, _ in good.values()]

    def _consumed(self, taken: dict[int, list[int]]) -> dict[int, int]:
        """The held version's marks moved past what ``taken`` takes."""
        consumed = dict(self.record.consumed)
        for learner, seqs in taken.items():
            consumed[learner] = max(seqs) + 1
        return consumed

    def _merge(self, gathered: Gathered) -> None:
        started = self.clock()
        v = self.newest
        merged, dropped, ages = self._combine(gathered.taken, v)
        record = Version(
            v + 1,
            self.writer,
            self._consumed(gathered.taken),
            merged,
            dropped,
            self.record.embeddings,
            parent=self.record.version,
            grace_s=gathered.grace_s,
            token_rows=self.record.token_rows,
            held_s=gathered.held_s,
            step_s=gathered.step_s,
        )
        outer = self.outer.state_dict() if self.outer is not None else None
        committed = versions.commit(self.run_store, record, self.params, outer, self.key)
        self.sync_s = self.clock() - started
        if committed:
            self.record, self.newest = record, record.version
            self._prune()
            logger.info(
                "merged version %d: %d contributions %s, staleness %s, dropped %d, grace %s s, in %.2fs",
                v + 1,
                len(merged),
                merged,
                ages,
                len(dropped),
                gathered.grace_s,
                self.sync_s,
            )
        else:
            logger.warning("another syncer committed version %d first: continuing from its", v + 1)
            self._load(v + 1)

    def _wait_for(self, look: Callable[[], T | None]) -> T:
        """What ``look`` finds in the store, polled until it finds something (a plan, another shard's part)."""
        self._beat("waiting")
        while (found := look()) is None:
            self.sleep(self._poll_s())
        return found

    def _plan(self) -> Plan:
        """Shard 0: the next version's plan, the one a predecessor created, or else this shard's choice (the
        quorum and the grace window), created once."""
        v = self.newest + 1
        plan = versions.read_plan(self.run_store, v)
        if plan is not None:
            logger.info("version %d's plan exists (a predecessor's): merging it", v)
            return plan
        gathered = self._gather()
        return versions.create_plan(
            self.run_store,
            Plan(
                v,
                self.record.version,
                gathered.taken,
                gathered.grace_s,
                gathered.held_s,
                gathered.step_s,
            ),
        )

    def _merge_plan(self, plan: Plan) -> None:
        """Shard 0: merge its fragment of ``plan``, then, once every shard's part exists, create the version's
        record naming them (deterministically: a second shard 0 would create the same one), and prune."""
        started = self.clock()
        parts = [self._merge_fragment(plan)]
        for fragment in range(1, self.shards):
            parts.append(
                self._wait_for(lambda f=fragment: versions.read_part(self.run_store, plan.version, f))
            )
        record = Version(
            plan.version,
            parts[0].writer,
            parts[0].consumed,
            [m for m in parts[0].merged if all(m in p.merged for p in parts[1:])],
            [d for p in parts for d in p.dropped],
            self.record.embeddings,
            parent=plan.parent,
            grace_s=plan.grace_s,
            token_rows=self.record.token_rows,
            fragments=self.record.fragments,
            parts=[p.writer for p in parts],
            held_s=plan.held_s,
            step_s=plan.step_s,
        )
        if not self.run_store.create(layout.version(plan.version), record.to_json()):
            logger.info("version %d's record exists (another syncer's)", plan.version)
            record = versions.read_version(self.run_store, plan.version)
        self.sync_s = self.clock() - started
        self.record, self.newest = record, plan.version
        self._prune()
        logger.info(
            "committed version %d: %d contributions %s, dropped %d, grace %s s, in %.2fs",
            plan.version,
            len(self.record.merged),
            self.record.merged,
            len(self.record.dropped),
            plan.grace_s,
            self.sync_s,
        )

    def _merge_part(self, plan: Plan) -> None:
        """Shard k > 0: merge its fragment of ``plan``; shard 0 commits the version."""
        self._merge_fragment(plan)
        self.newest = plan.version

    def _merge_fragment(self, plan: Plan) -> Version:
        """This shard's part of ``plan``'s version: merged from the global of ``plan.parent`` and created once,
        or, when it exists already (this shard's predecessor's, or a second shard's), taken up from the store.
        Returns the part's record, which it then holds."""
        v = plan.version
        part = versions.read_part(self.run_store, v, self.shard)
        if part is None:
            if plan.parent != self.record.version:  # shard 0 rolled back past a damaged version
                logger.warning(
                    "version %d steps from version %d: taking up that one's global", v, plan.parent
                )
                self._take_up(versions.read_version(self.run_store, plan.parent))
            merged, dropped, ages = self._combine(plan.taken, v - 1)
            part = Version(
                v,
                self.writer,
                self._consumed(plan.taken),
                merged,
                dropped,
                self.record.embeddings,
                parent=plan.parent,
                grace_s=plan.grace_s,
                token_rows=self.record.token_rows,
                fragments=self.record.fragments,
                step_s=plan.step_s,  # the shard's polls' pace (``_poll_s``)
            )
            assert self.outer is not None
            if versions.commit_part(
                self.run_store, part, self.shard, self.params, self.outer.state_dict(), self.key
            ):
                self.record = part
                logger.info(
                    "merged fragment %d of version %d: %d contributions, staleness %s, dropped %d",
                    self.shard,
                    v,
                    len(merged),
                    ages,
                    len(dropped),
                )
                return part
            part = versions.read_part(self.run_store, v, self.shard)
            assert part is not None  # its creation failed: it exists
        logger.info("fragment %d of version %d exists (%s's): taking it up", self.shard, v, part.writer)
        self._take_up(part)
        return part

    def _take_up(self, record: Version) -> None:
        """Hold this shard's fragment of ``record``'s global (a version's, or a part's) and its outer state."""
        store = self.run_store
        params = versions.load_part(store, record, self.shard, self.key)
        # a version's record names each fragment's writer; a part's, only its own
        fragment = self.shard if record.parts else 0
        outer = versions.load_outer(store, record, self.key, fragment) if record.version > 0 else None
        self._hold(record, params, outer)

    def _read(self, learner: int, seq: int) -> tuple[Contribution, torch.Tensor]:
        """Contribution ``seq`` of ``learner``, checked, with its row bits when the run has them."""
        numel = sum(t.numel() for t in self.params.values())
        return versions.read_contribution(
            self.run_store,
            self.config.run_id or "",
            learner,
            seq,
            self.codec,
            numel,
            self.key,
            self.row_bits,
            fragment=self.shard if self.shards > 1 else None,
        )

    def _touched_rows(self, average: torch.Tensor, good: list[tuple[Contribution, torch.Tensor]]) -> None:
        """Replace ``average``'s embedding rows that some merged contribution's data held by lock-step's
        touched-rows combination (``rows.RowSums``: the contributions added in the merge's order, as lock-step's
        reducer adds its inputs in rank order). Those rows are combined unweighted, as lock-step's: the
        contributions' weights (tokens, a staleness discount) act on the other rows."""
        numel = average.numel()
        sums = RowSums(self.row_spans, numel, bucket_count(self.config.diloco.sync_every))
        for c, values in good:
            assert c.touched is not None  # read with row bits (self.row_bits)
            sums.add(values, c.touched)
        sums.apply(average)

    def _merged(self, flats: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
        """The contributions (flat, in the global's parameter order) merged tensor by tensor
        (``merge.merge_tensors``), flat again."""
        dc = self.config.diloco.decoupled
        named = []
        for flat in flats:
            tensors, offset = {}, 0
            for name, p in self.params.items():
                tensors[name] = flat[offset : offset + p.numel()]
                offset += p.numel()
            named.append(tensors)
        merged = merge_tensors(named, weights, dc.average, plain=self.record.embeddings)
        return torch.cat([merged[name] for name in self.params])

    @torch.no_grad()
    def _outer_step(self, average: torch.Tensor, count: int) -> None:
        """The outer optimizer's step on the global with ``average`` (the merge of ``count`` contributions) as
        its gradient, after the round trip through the reduced codec every lock-step replica applies (its
        decoding of the published average). Delayed Nesterov counts its delay in contributions."""
        if self.reduced != "fp32":
            identity = {"kind": "average"}
            average = decode(encode(average, identity, self.reduced), identity, self.reduced, average.numel())
        offset = 0
        for p in self.params.values():
            grad = average[offset : offset + p.numel()].view_as(p)
            p.grad = grad if grad.dtype == p.dtype else grad.to(p.dtype)
            offset += p.numel()
        assert self.outer is not None
        if isinstance(self.outer, DelayedNesterov):
            self.outer.step(count=count)
        else:
            self.outer.step()
        self.outer.zero_grad()
