"""A learner of ``diloco.mode = "decoupled"``: the replica's inner loop, with no barrier.

It runs the lock-step replica's inner step (``trainer.Replica._inner_step``: the objective, the inner
optimizer and its schedule, the discarded non-finite steps), but no DiLoCo wraps the optimizer. After every
``sync_every`` inner steps (fewer for a learner slower than the fastest, ``_pace``; lengthened once by the
time the syncer held its previous contribution waiting for the others', ``_align``) it publishes its
contribution, its progress not sent yet: the parameters its last contribution or its last adoption left it
at, whichever is later, minus its local parameters (``rendezvous/decoupled.py``), with the version of the
global it holds and its tokens and steps, and goes on.
So each inner step's progress is sent exactly once: a learner ``max_lag`` ahead that finds no newer global
after publishing trains on from where it published, and its next contribution holds only the steps since. It
waits for no other learner; it waits for the syncer only as far as ``diloco.decoupled.max_lag`` says: it
starts its next round once at most ``max_lag`` of its contributions are unmerged. It adopts the newest global
version right after publishing (``adopt_when = "publish"``) or, with ``"arrival"``, at the first inner-step
boundary after its background reader (``arrivals.py``) has read it, without waiting for the read: with
``adopt = "keep"`` its progress not sent yet is carried onto it (and sent with its next contribution), with
``"overwrite"`` it is discarded and those steps are not counted in its next contribution. The global it holds
(``base``: what it scores, exports, and names in its contributions) and the point its contributions have
accounted for (``sent_to``) are kept apart: after a publish with no newer global they differ. The inner
optimizer's state is kept across adoptions, as lock-step's DiLoCo keeps it across syncs. Each adoption ends
the objective's round (``Objective.round_ended``: the composer objective's completions and recorded rollouts
go with the adopted version). Only trainable parameters travel: with LoRA, the adapters.

With ``max_lag = 0`` a learner's schedule is lock-step's: train H steps from global v, publish, adopt v + 1;
with a syncer that merges every learner's contribution with lock-step's arithmetic, the run is lock-step's bit
for bit (tests/syncer/test_oracle.py).

A learner keeps its own state in the store as lock-step's replica does at a checkpoint (``state.own_state``:
inner optimizer, schedule position, data position, RNG; ``checkpoint.save_replica``'s snapshot, with its
checksums or MACs), once per contribution, written just before it under the contribution's sequence number
(``layout.replica_state(rank, seq)``). A restarted learner (killed, preempted, or resumed with the run) holds the
newest intact global version and restores the newest own state whose contribution is in the store: a state
written by a learner that died before its contribution is passed over, so the data of that round is trained
again and published once. Its local parameters are not kept: they are its contribution's base minus the
contribution, and a restart adopts the newest global instead (what ``adopt = "overwrite"`` does).

A learner of G ranks (FSDP2, ``replicas/shards.py``) trains as the lock-step replica's ranks do and acts as
one learner towards the store: every rank computes the pseudo-gradient of its own shards, the lead (local
rank 0) gathers them whole and publishes the learner's one contribution, and reads the version to adopt and
scatters it, each rank keeping its shard. The contribution stays one object, created once with one header (so
the syncer, unchanged, can never mix shards of different versions or attempts), and the learner's link
carries the same bytes as with one rank (S up, P down): gathering and scattering run on the node's own
interconnect. Which version the learner adopts and when it may go on, the lead decides and broadcasts; each
rank saves and restores its own shards of the learner's state, as a lock-step replica's ranks do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from typing import Any

import torch

from composer_serverless.rendezvous import checkpoint, layout
from composer_serverless.rendezvous import decoupled as store_versions
from composer_serverless.rendezvous.checkpoint import CheckpointError
from composer_serverless.rendezvous.decoupled import Contribution, Version
from composer_serverless.rendezvous.fragments import fragment_groups
from composer_serverless.rendezvous.latest import newest_version
from composer_serverless.rendezvous.rows import RowMask, spans
from composer_serverless.replicas import state
from composer_serverless.replicas.arrivals import Arrivals
from composer_serverless.replicas.diloco import wire_codec
from composer_serverless.replicas.meter import trained_tokens
from composer_serverless.replicas.shards import local, shard_of, whole_of_shard
from composer_serverless.replicas.trainer import Replica
from composer_serverless.replicas.weights import check_initial_weights, digest


class DecoupledLearner(Replica):
    """One learner: inner steps, contributions, adoptions (see the module)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.params = {name: p for name, p in self.model.named_parameters() if p.requires_grad}
        self.version = -1  # the global version it holds
        self.base: dict[str, torch.Tensor] = {}  # that version's parameters, in host memory
        # What its contributions have accounted for, in host memory: the local parameters at its last
        # contribution, or the global it adopted since (empty before the first adoption)
        self.sent_to: dict[str, torch.Tensor] = {}
        self.seq = 0  # its next contribution's sequence number
        self.sent: list[dict[str, Any]] = []  # the rows of its contributions since its last adoption
        # The inner steps of the round in progress whose progress an adoption with adopt = "overwrite"
        # discarded (the first ones of the round): its contribution neither carries nor counts them.
        self.discarded = 0
        # With embedding_average = "touched" (``self.touches``): the parameters with a row per token, whose
        # rows' bits its contributions carry (lock-step's touched-rows average, done by the syncer)
        marked = {id(w) for w in self.touches.token_weights} if self.touches is not None else set()
        self.token_rows = [name for name, p in self.params.items() if id(p) in marked]
        # With a sharded syncer: the fragments its contributions are cut into (version 0's record names them)
        self.fragments: list[list[str]] = []
        # Its rounds' inner steps (sync_every, fewer for a slower learner: ``_pace``); the round in progress's
        # lengthening (``_align``) and its least steps (one after a mid-round adoption); the contribution whose
        # merge lengthened one last (``self.seq`` then); its latest seconds per inner step
        self.pace = self.config.diloco.sync_every
        self.extra = self.least = 0
        self.aligned = 0
        self.step_s: float | None = None

    @property
    def round_steps(self) -> int:
        """The inner steps of the round in progress: its pace, lengthened by ``_align``, and at least one
        after a mid-round adoption (an overwriting one discarded the steps before it: a contribution is
        never empty)."""
        return max(self.pace + self.extra, self.least)

    @property
    def completed_rounds(self) -> int:
        return max(self.version, 0)

    def _last_global(self) -> dict[str, torch.Tensor]:
        """Where a discarded step goes back to: the point its contributions have accounted for, so that the
        discarded steps are the unsent ones (going back to ``base`` after a publish would send the negation
        of progress already sent)."""
        return self.sent_to

    def run(self) -> None:
        dl = self.config.diloco
        record = self._start()
        # With max_lag = 0 a learner waits for its own merge after each publish (lock-step's schedule), so it
        # adopts there whatever adopt_when says.
        arrival = dl.decoupled.adopt_when == "arrival" and dl.decoupled.max_lag > 0
        reader = (  # the lead reads for the learner's ranks
            Arrivals(self.run_store, self.key, self.version, self._poll_s())
            if arrival and self.node.lead
            else None
        )
        with reader or contextlib.nullcontext():
            while record.version < dl.rounds:
                self.meter.reset()
                self.discarded = 0
                while self.meter.steps < self.round_steps and self.version < dl.rounds:
                    self._inner_step()
                    # not after the round's last step: its publish follows, then the look below (an
                    # overwrite there would leave the contribution no step)
                    if arrival and self.meter.steps < self.round_steps:
                        self._adopt_arrived(reader, at_step=self.meter.steps)
                if self.version >= dl.rounds:  # the last version arrived mid-round: nothing to train for
                    record = store_versions.read_version(self.run_store, self.version)
                    break
                self._publish()
                if reader is not None:  # its step time is measured: a hundredth of its round, unset
                    reader.poll_s = self._poll_s()
                record = self._wait_for_syncer()
                if arrival and record.version < dl.rounds:
                    self._adopt_arrived(reader, at_step=0)  # what was read; the rest at a later step
                elif record.version > self.version:
                    record = self._adopt_newest(record)
        self._finish(record)

    def _start(self) -> Version:
        """Hold the newest global version (creating version 0 from the initial weights if there is none)."""
        store, node = self.run_store, self.node
        own = self.rank
        # Every learner, fresh or restarted (it loaded the model afresh): a version holds the trainable
        # parameters only, so with LoRA the frozen base each learner adapts must be the others'.
        check_initial_weights(store, self.model, self.rank, node)
        # Listed before the newest record is read: a contribution the syncer pruned meanwhile was consumed
        # by a version no newer than the one adopted below, whose mark then counts it.
        listed = [int(n) for n in store.list(layout.contributions(own)) if n.isdigit()] if node.lead else []
        newest = node.broadcast(newest_version(store) if node.lead else -1)
        if newest < 0:
            initial = self._gathered({name: local(p).detach() for name, p in self.params.items()})
            shards = self.config.diloco.decoupled.syncer_shards
            cut = shards > 1 and node.lead  # the lead alone holds the whole initial weights, and commits
            record = Version(
                0,
                store_versions.writer_token(),
                embeddings=self._embedding_names(),
                token_rows=self.token_rows,
                # each shard of the syncer merges one; cut once, here, so every learner and shard agree
                fragments=fragment_groups([(n, t.numel()) for n, t in initial.items()], shards)
                if cut
                else [],
            )
            if node.lead and (
                store_versions.commit_fragments(store, record, initial, self.key)
                if record.fragments
                else store_versions.commit(store, record, initial, None, self.key)
            ):
                self.log.info("wrote global version 0 (the initial weights)")
            newest = node.broadcast(0)  # once the lead's commit returned: its ranks read what it wrote
        self._evaluate_initial()
        params: dict[str, torch.Tensor] = {}  # read by the lead, scattered by _adopt
        if node.lead:
            record, params, _ = store_versions.newest_intact(store, newest, self.key, outer=False)
            node.broadcast(record.version)
        else:
            record = store_versions.read_version(store, node.broadcast(-1))
        self.fragments = record.fragments
        if node.lead:
            self.seq = max(record.consumed.get(own, 0), max(listed, default=-1) + 1)
        self.seq = node.broadcast(self.seq)
        self.aligned = self.seq  # a restart has no phase to make up: what it held before is gone
        self._adopt(record, params)
        self._restore_own(record.version)
        return record

    def _evaluate_initial(self) -> None:
        """The lowest-rank learner scores version 0, the initial model, as lock-step's replicas score round 0
        (the row of round 0 with its ``eval``, which status, the report and the trackers read as the initial
        evaluation). It scores its own weights, freshly loaded and checked against the run's initial digest
        (``check_initial_weights``: what version 0 holds, whichever learner wrote it), before it adopts any
        version: so however late it starts, and even if the syncer has pruned version 0, it scores the initial
        model. The other learners train on meanwhile; a restart that finds the row written does not score again."""
        if self.rank != 0:
            return
        lead = self.node.lead
        if self.node.broadcast(int(self.run_store.exists(layout.metrics(self.rank, 0))) if lead else 0):
            return
        initial = self._evaluate(0, [self.rank])
        if initial is not None:
            self.reporter.round(0, {"eval": initial, "time": time.time()})

    def _restore_own(self, version: int) -> None:
        """Continue this learner's inner loop from its newest own state whose contribution is in the store
        (the one just before its next, ``self.seq``), or, with none, from a fresh inner optimizer, its
        schedule placed at global version ``version``."""
        self.schedule = self._schedule_at(version)
        node = self.node
        saved = (
            checkpoint.load_replica(
                self.run_store, self.rank, self.seq - 1, node.local_rank, node.all_true, key=self.key
            )
            if self.seq
            else None
        )
        if saved is None:
            if version:
                self.log.warning(
                    "started from global version %d with a fresh inner optimizer (no state of its own)",
                    version,
                )
            return
        seq, own = saved
        state.restore_own(
            own,
            inner=self.inner,
            objective=self.objective,
            model=self.model,
            schedule=self.schedule,
            device=self.device,
        )
        self._follow_global(version)  # its state may be of a contribution merged versions ago
        self.log.info(
            "started from global version %d and its own state of contribution %d: inner step %d, data "
            "position %s",
            version,
            seq,
            self.schedule.last_epoch,
            own["objective"],
        )

    def _follow_global(self, version: int) -> None:
        """Place the inner learning-rate schedule at global version ``version``'s place, ``version`` x H
        steps done (where a learner that starts at that version is placed), at every adoption and restart.

        ``diloco.rounds`` counts versions and the schedule spans rounds x H inner steps, but a learner's own
        steps do not follow the versions: with a quorum below every learner each version merges fewer than N
        contributions, so each learner trains fewer rounds than there are versions (a schedule that followed
        its own steps would end the run part-way down its decay: the cosine at half its course with a quorum
        of 2 of 4, measured, ``docs/RESULTS.md`` section 25); and a learner that lengthened rounds to keep in
        step with the others (``_align``) runs a few steps ahead of its version's place. Following the
        global keeps the schedule on the run's progress, ending with its last version, also for a learner
        that restarts or joins late; a learner ahead goes back those few steps. With ``max_lag = 0`` and every
        learner in each merge it is at that place already (lock-step's schedule, bit for bit)."""
        if self.schedule.last_epoch != version * self.config.diloco.sync_every:
            self.schedule = self._schedule_at(version)

    def _save_own(self) -> int:
        """Write this learner's own state before its contribution ``self.seq``, and drop its states before the
        one of its last contribution (the newest a restart could need if this one's contribution is never
        written). Its local parameters are left out (no global copy given: see the module). Returns the
        bytes written."""
        own = state.own_state(self.model, self.inner, self.schedule, self.objective, {}, self.device)
        written = checkpoint.save_replica(
            self.run_store, self.rank, self.seq, own, self.node.local_rank, prune=False, key=self.key
        )
        if self.node.lead:
            checkpoint.prune_numbered(
                self.run_store, layout.replica_states(self.rank), keep_from=self.seq - 1
            )
        return written

    def _embedding_names(self) -> list[str]:
        """The names of the embeddings' trainable parameters (input, and an untied output head)."""
        modules = [self.model.get_input_embeddings(), self.model.get_output_embeddings()]
        ids = {id(p) for m in modules if m is not None for p in m.parameters()}
        return [name for name, p in self.params.items() if id(p) in ids]

    def _gathered(self, shards: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The whole tensors, on the CPU, of this rank's ``shards`` of the learner's parameters: on the lead
        (a collective over the learner's ranks); empty on the other ranks."""
        out = {}
        for name, p in self.params.items():
            tensor = whole_of_shard(shards[name], p).to("cpu")
            if self.node.lead:
                out[name] = tensor
        return out

    @torch.no_grad()
    def _publish(self) -> None:
        """Send the progress not sent yet, ``sent_to`` minus the local parameters (in their dtype, as
        torchft computes a pseudo-gradient), flat in the global's parameter order; the local parameters
        become ``sent_to``. Each rank subtracts its own shards (elementwise, so the whole is what one rank
        would compute); the lead gathers and sends."""
        dl, node = self.config.diloco, self.node
        lr = self.schedule.get_last_lr()[0]
        row = self.meter.row(lr)
        # the steps whose progress it carries: not those an overwriting adoption discarded
        steps = row["steps"] - self.discarded
        tokens = sum(int(trained_tokens(m) or 0) for m in self.meter.metrics[self.discarded :])
        # the time those steps took, for the syncer's grace window (the lead's clock: its ranks step together)
        seconds = sum(s["time_s"]["step"] for s in row["step_rows"][self.discarded :])
        self.step_s = seconds / steps if steps else self.step_s
        if node.size > 1:  # each rank trained on its share of the learner's batch
            loss = row["train_loss"]
            row["train_loss"] = None if loss is None else node.sum([loss])[0] / node.size
            tokens = int(node.sum([tokens])[0])
        now = {name: local(p).detach().to("cpu", copy=True) for name, p in self.params.items()}
        deltas = self._gathered({name: self.sent_to[name] - now[name] for name in now})
        # the rows its data held since its last contribution, over its ranks (every rank takes: a collective)
        mask = self.touches.take(0) if self.token_rows and self.touches is not None else None
        written = self._save_own()
        sent = 0
        if node.lead:
            run_id, codec = self.config.run_id or "", wire_codec(dl.codec, dl)
            contribution = Contribution(self.rank, self.seq, self.version, tokens, steps, seconds)
            parts = [self._flat(deltas, names, mask) for names in self.fragments or [list(self.params)]]
            if self.fragments:
                sent = store_versions.publish_parts(
                    self.run_store, run_id, contribution, parts, codec, self.key
                )
            else:
                values, touched = parts[0]
                contribution = dataclasses.replace(contribution, touched=touched)
                sent = store_versions.publish(self.run_store, run_id, contribution, values, codec, self.key)
        self.sent_to = now
        own = {
            "bytes_up": sent,
            "checkpoint_bytes_up": written,
            "contribution": self.seq,
            "base_version": self.version,
            "tokens": tokens,
            "discarded_steps": self.discarded,  # the round's first ones (its step_rows), not sent
        }
        self.sent.append({**row, **own})
        self.seq += 1
        self.extra = self.least = 0  # the next round is its pace, until an adoption lengthens it (``_align``)

    def _flat(
        self, deltas: dict[str, torch.Tensor], names: list[str], mask: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The tensors ``names`` of ``deltas`` flat in fp32 (the whole contribution, or a fragment of it), and
        with ``mask`` (``Touches.take``'s) the row bits of the token-indexed ones among them."""
        values = torch.cat([deltas[name].reshape(-1).to(torch.float32) for name in names])
        if mask is None:
            return values, None
        blocks = store_versions.row_blocks({n: tuple(deltas[n].shape) for n in names}, self.token_rows)
        return values, RowMask(blocks, mask.touched).bits(spans(blocks, 0, values.numel()))

    def _wait_for_syncer(self) -> Version:
        """The newest global version, once at most ``max_lag`` of this learner's contributions are unmerged
        (or the run's last version exists). The lead looks and tells its ranks at every poll, found or not
        (-1), so that no rank sits in one collective for longer than a poll however long the syncer takes."""
        dl, node = self.config.diloco, self.node
        allowed = self.seq - dl.decoupled.max_lag
        told = False
        while True:
            found = -1
            if node.lead:
                record = store_versions.read_version(self.run_store, newest_version(self.run_store))
                if record.version >= dl.rounds or record.consumed.get(self.rank, 0) >= allowed:
                    found = record.version
            found = node.broadcast(found)
            if found >= 0:
                return record if node.lead else store_versions.read_version(self.run_store, found)
            if not told:
                self.log.info("waiting for the syncer to merge contribution %d", allowed - 1)
                self.reporter.beat(state="waiting", round=self.version + 1, rounds=dl.rounds)
                told = True
            time.sleep(self._poll_s())

    def _poll_s(self) -> float:
        """Seconds between its listings (``DecoupledConfig.poll_every``): unset, a hundredth of its round."""
        dl = self.config.diloco
        return dl.decoupled.poll_every(dl.sync_every, self.step_s)

    def _adopt_newest(self, record: Version) -> Version:
        """Adopt the newest version, ``record``, or a newer one if it was pruned meanwhile
        (``read_or_newer``); the version held after. One that does not read whole and has no newer (damaged
        after its commit) is passed over: this learner trains on from the global it holds, and adopts the
        syncer's next version, which a restarted syncer merges from the newest intact one (``Syncer._load``)."""
        node, store = self.node, self.run_store
        params: dict[str, torch.Tensor] = {}
        damaged = None
        if node.lead:  # it reads the version for the learner's ranks (see _adopt)
            try:
                record, params = store_versions.read_or_newer(
                    store, record, lambda r: store_versions.load_params(store, r, self.key)
                )
            except (CheckpointError, FileNotFoundError) as e:
                damaged = e
        if not node.all_true(damaged is None):
            self.log.warning(
                "global version %d cannot be read, keeping version %d: %s",
                record.version,
                self.version,
                damaged or "its learner's lead could not read it",
            )
            return store_versions.read_version(store, self.version)
        taken = node.broadcast(record.version)
        if not node.lead:
            record = store_versions.read_version(store, taken)
        self._adopt(record, params)
        return record

    def _adopt_arrived(self, reader: Arrivals | None, at_step: int) -> None:
        """Adopt the newest version ``reader`` has read since the last look, if any, without waiting: at
        inner step ``at_step`` of the round in progress (0: right after a publish). The lead looks and tells
        its ranks (one integer broadcast per step, nothing with one rank); its reader's failure, told as -2,
        stops every rank."""
        node = self.node
        arrived, failure, found = None, None, -1
        if node.lead:
            assert reader is not None
            try:
                arrived = reader.take(self.version)
            except Exception as e:
                failure, found = e, -2
            else:
                found = -1 if arrived is None else arrived[0].version
        found = node.broadcast(found)
        if found == -2:
            raise failure or RuntimeError("this learner's lead failed reading a newer global version")
        if found < 0:
            return
        record, params = (
            arrived if arrived is not None else (store_versions.read_version(self.run_store, found), {})
        )
        self._adopt(record, params, at_step)

    @torch.no_grad()
    def _adopt(self, record: Version, params: dict[str, torch.Tensor], at_step: int = 0) -> None:
        """Take ``params``, global version ``record``'s (whole, on the lead; empty on the learner's other
        ranks), as this learner's parameters, at inner step ``at_step`` of the round in progress (0: at a
        publish, when nothing is unsent). With ``adopt = "keep"`` its progress not sent yet is carried onto
        it (its next contribution sends it: ``sent_to`` becomes the global); with ``"overwrite"`` that
        progress is discarded and those steps are not counted in its next contribution (``discarded``). The
        lead scatters it: each rank keeps its shards (the learner's link carries the version once, whatever
        its ranks)."""
        node = self.node
        if not node.all_true(not node.lead or set(params) == set(self.params)):
            raise ValueError(f"global version {record.version} does not hold this model's parameters")
        keep = self.config.diloco.decoupled.adopt == "keep" and self.sent_to
        overwritten = 0 if keep or not at_step else at_step - self.discarded
        self.discarded += overwritten
        if overwritten and self.touches is not None:  # the rows those steps marked are not sent either
            self.touches.clear()
        shards = {}
        for name, p in self.params.items():
            shards[name] = shard_of(params.get(name), p).to("cpu")
            target = local(p)
            if keep:
                progress = target - self.sent_to[name].to(target.device)
                target.copy_(shards[name]).add_(progress)
            else:
                target.copy_(shards[name])
        was, self.version = self.version, record.version
        self.base = self.sent_to = shards
        self.nonfinite = 0
        self._follow_global(record.version)
        self._pace(record)
        self._align(record)
        if at_step:  # the round runs at least one more step (``round_steps``)
            self.least = max(self.least, at_step + 1)
        if was < 0:
            return
        # A row per version adopted (the trackers' rounds are versions): the rounds trained since the last
        # one, the last one's figures first (the earlier ones' steps and traffic too: the trackers place
        # each contribution's steps at the version that merged it), and the digest of the global now held.
        row: dict[str, Any] = {**(self.sent[-1] if self.sent else {}), "time": time.time()}
        if len(self.sent) > 1:
            row["earlier_step_rows"] = [r["step_rows"] for r in self.sent[:-1]]
            row["bytes_up"] = sum(r["bytes_up"] for r in self.sent)
        row.update(
            version=record.version,
            contributions=[r["contribution"] for r in self.sent],
            adopted_at_step=at_step,
            overwritten_steps=overwritten,
        )
        if self.config.diloco.verify_global and node.lead:  # of the whole global: the same whatever G
            row["global_sha256"] = digest(params)
        # What the objective does between rounds, per version: the composer objective's completions table,
        # and its rollouts recorded under this version (composer.record_rollouts).
        row.update(
            self.objective.round_ended(
                record.version, lambda: self._global_model(shards), self._waiting(record.version)
            )
        )
        self.reporter.round(record.version, row)
        self.sent = []
        self.log.info("adopted global version %d (held %d)", record.version, was)

    def _align(self, record: Version) -> None:
        """With ``diloco.decoupled.align``: at the first version that merged every contribution this learner
        has published, lengthen the round in progress by the inner steps of the time the syncer held its
        contribution waiting for the merge's last one (``record.held_s``), so that its next contribution
        arrives with the others'.

        Without it each learner keeps the phase its start gave it: the grace window waits for the late ones,
        and a learner that publishes early adopts each version later in its next round, those steps computed
        on the global before (measured, ``docs/RESULTS.md`` section 27). Lengthened once per contribution and
        by less than a round, a learner never waits and a slow one is not held back; the learner that came
        last (held 0) keeps its pace, so the rounds stay ``sync_every`` steps long once in step. A learner of
        several ranks lengthens by its lead's count, broadcast (its ranks' step times differ a little). With
        ``max_lag = 0`` every learner waits for its own merge and starts its next round there: in step
        already, lock-step's schedule (the oracle's), so nothing is lengthened."""
        dc = self.config.diloco.decoupled
        if not dc.align or dc.max_lag == 0 or self.aligned == self.seq:
            return
        if record.consumed.get(self.rank, 0) < self.seq:
            return
        self.aligned = self.seq
        held = record.held_s.get(self.rank, 0.0)
        extra = min(round(held / self.step_s), self.pace - 1) if self.step_s else 0
        extra = self.node.broadcast(extra)  # the lead's: its ranks' step times differ a little
        if extra:
            self.extra = extra
            self.log.debug("%.2fs ahead of the others: %d inner steps this round", held, self.round_steps)

    def _pace(self, record: Version) -> None:
        """With ``diloco.decoupled.dynamic_steps``: make this learner's rounds ``sync_every`` x (the fastest
        seconds per inner step / its own) steps long (at least 1), the fastest taken from the learners
        ``record`` merged (``record.step_s``) and itself, its own from its last contribution (Async Local-SGD's
        dynamic local updates, ``../shared/research/wave4.md`` section 2). The round in progress changes by as
        much, but runs at least one step after the adoption (``round_steps``).

        Without it a learner at half speed publishes every other merge: the syncer's grace window waits for
        it in the merges it misses, so the others adopt each version later in their rounds, and its own
        steps run on a global two versions old by the time they are merged (measured, ``docs/RESULTS.md``
        section 28). Paced, every learner's contribution arrives together, each weighted by its tokens. A
        learner of several ranks takes its lead's count. With ``max_lag = 0`` the learners wait for their
        merges, lock-step's schedule (the oracle's): nothing changes."""
        dc, sync_every = self.config.diloco.decoupled, self.config.diloco.sync_every
        if not dc.dynamic_steps or dc.max_lag == 0:
            return
        pace = self.pace
        if self.step_s:
            fastest = min([*record.step_s.values(), self.step_s])
            pace = max(1, min(sync_every, round(sync_every * fastest / self.step_s)))
        pace = self.node.broadcast(pace)  # the lead's: its ranks' step times differ a little
        if pace != self.pace:
            self.log.debug("%.3fs per step: %d inner steps per round", self.step_s, pace)
            self.pace = pace

    def _finish(self, record: Version) -> None:
        """The run's last version is held: the lowest-rank learner merged into it scores it and uploads it."""
        dl = self.config.diloco
        merged = sorted({learner for learner, _ in record.merged})
        if merged and merged[0] == self.rank:
            scored = self._evaluate(record.version, [self.rank], self.base)
            self._upload_final(self.base)
            if scored is not None:
                row = self.run_store.get(layout.metrics(self.rank, record.version))
                self.reporter.round(record.version, {**json.loads(row), "eval": scored})
        self.reporter.beat(
            state="done", round=dl.rounds, rounds=dl.rounds, step=dl.sync_every, steps=dl.sync_every
        )
