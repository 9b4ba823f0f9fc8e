"""A learner of ``diloco.mode = "decoupled"``: the replica's inner loop, with no barrier.

It runs the lock-step replica's inner step (``trainer.Replica._inner_step``: the objective, the inner
optimizer and its schedule, the discarded non-finite steps), but no DiLoCo wraps the optimizer. After every
``sync_every`` inner steps it publishes its contribution, the global it started from minus its local
parameters (``rendezvous/decoupled.py``), with that global's version and its tokens and steps, and goes on.
It waits for no other learner; it waits for the syncer only as far as ``diloco.decoupled.max_lag`` says: it
starts its next round once at most ``max_lag`` of its contributions are unmerged. At a round boundary it adopts
the newest global version: with ``adopt = "keep"`` its inner steps since publishing are carried onto it, with
``"overwrite"`` they are discarded. The inner optimizer's state is kept across adoptions, as lock-step's
DiLoCo keeps it across syncs.

With ``max_lag = 0`` a learner's schedule is lock-step's: train H steps from global v, publish, adopt v + 1;
with a syncer that merges every learner's contribution with lock-step's arithmetic, the run is lock-step's bit
for bit (tests/syncer/test_oracle.py).

Not kept yet: a learner's own state (inner optimizer, data position) in the store. A restarted learner
starts from the newest global version with a fresh inner optimizer, its schedule placed at that version.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch

from composer_serverless.rendezvous import decoupled as store_versions
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.decoupled import Contribution, Version
from composer_serverless.replicas.diloco import wire_codec
from composer_serverless.replicas.meter import trained_tokens
from composer_serverless.replicas.shards import local
from composer_serverless.replicas.trainer import Replica
from composer_serverless.replicas.weights import check_initial_weights, digest


class DecoupledLearner(Replica):
    """One learner: inner steps, contributions, adoptions (see the module)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.params = {name: p for name, p in self.model.named_parameters() if p.requires_grad}
        self.version = -1  # the global version it holds
        self.base: dict[str, torch.Tensor] = {}  # that version's parameters, in host memory
        self.published: dict[str, torch.Tensor] | None = None  # local parameters at the last contribution
        self.seq = 0  # its next contribution's sequence number
        self.sent: list[dict[str, Any]] = []  # the rows of its contributions since its last adoption

    @property
    def completed_rounds(self) -> int:
        return max(self.version, 0)

    def _last_global(self) -> dict[str, torch.Tensor]:
        return self.base

    def run(self) -> None:
        dl = self.config.diloco
        record = self._start()
        while record.version < dl.rounds:
            self.meter.reset()
            while self.meter.steps < dl.sync_every:
                self._inner_step()
            self._publish()
            record = self._wait_for_syncer()
            if record.version > self.version:
                record = self._adopt(record)
        self._finish(record)

    def _start(self) -> Version:
        """Hold the newest global version (creating version 0 from the initial weights if there is none)."""
        store = self.run_store
        own = self.rank
        # Listed before the newest record is read: a contribution the syncer pruned meanwhile was consumed
        # by a version no newer than the one adopted below, whose mark then counts it.
        listed = [int(n) for n in store.list(layout.contributions(own)) if n.isdigit()]
        newest = store_versions.newest_version(store)
        if newest < 0:
            check_initial_weights(store, self.model, self.rank, self.node)
            initial = {name: local(p).detach().to("cpu", copy=True) for name, p in self.params.items()}
            record = Version(0, store_versions.writer_token(), embeddings=self._embedding_names())
            if store_versions.commit(store, record, initial, None, self.key):
                self.log.info("wrote global version 0 (the initial weights)")
            newest = 0
        record = self._adopt(store_versions.read_version(store, newest))
        self.seq = max(record.consumed.get(own, 0), max(listed, default=-1) + 1)
        self.schedule = self._schedule_at(record.version)
        if record.version:
            self.log.warning(
                "started from global version %d with a fresh inner optimizer (learners keep no state of "
                "their own yet)",
                record.version,
            )
        return record

    def _embedding_names(self) -> list[str]:
        """The names of the embeddings' trainable parameters (input, and an untied output head)."""
        modules = [self.model.get_input_embeddings(), self.model.get_output_embeddings()]
        ids = {id(p) for m in modules if m is not None for p in m.parameters()}
        return [name for name, p in self.params.items() if id(p) in ids]

    @torch.no_grad()
    def _publish(self) -> None:
        """Send the global this learner started from minus its local parameters (in their dtype, as
        torchft computes a pseudo-gradient), flat in the global's parameter order."""
        dl = self.config.diloco
        lr = self.schedule.get_last_lr()[0]
        row = self.meter.row(lr)
        deltas = [(self.base[name] - local(p).to("cpu")).reshape(-1) for name, p in self.params.items()]
        values = torch.cat([d.to(torch.float32) for d in deltas])
        tokens = sum(int(trained_tokens(m) or 0) for m in self.meter.metrics)
        contribution = Contribution(self.rank, self.seq, self.version, tokens, row["steps"])
        sent = store_versions.publish(
            self.run_store, self.config.run_id or "", contribution, values, wire_codec(dl.codec, dl), self.key
        )
        if self.config.diloco.decoupled.adopt == "keep":
            self.published = {name: local(p).detach().clone() for name, p in self.params.items()}
        own = {"bytes_up": sent, "contribution": self.seq, "base_version": self.version, "tokens": tokens}
        self.sent.append({**row, **own})
        self.seq += 1

    def _wait_for_syncer(self) -> Version:
        """The newest global version, once at most ``max_lag`` of this learner's contributions are unmerged
        (or the run's last version exists)."""
        dl = self.config.diloco
        allowed = self.seq - dl.decoupled.max_lag
        told = False
        while True:
            record = store_versions.read_version(
                self.run_store, store_versions.newest_version(self.run_store)
            )
            if record.version >= dl.rounds or record.consumed.get(self.rank, 0) >= allowed:
                return record
            if not told:
                self.log.info("waiting for the syncer to merge contribution %d", allowed - 1)
                self.reporter.beat(state="waiting", round=self.version + 1, rounds=dl.rounds)
                told = True
            time.sleep(dl.decoupled.poll_s)

    @torch.no_grad()
    def _adopt(self, record: Version) -> Version:
        """Take global version ``record`` (or the newest, if it was pruned meanwhile) as this learner's
        parameters (with ``adopt = "keep"``, plus its inner steps since its last contribution); the version
        taken."""
        record, params = store_versions.read_or_newer(
            self.run_store, record, lambda r: store_versions.load_params(self.run_store, r, self.key)
        )
        if set(params) != set(self.params):
            raise ValueError(f"global version {record.version} does not hold this model's parameters")
        for name, p in self.params.items():
            target = local(p)
            if self.published is not None:
                progress = target - self.published[name]
                target.copy_(params[name]).add_(progress)
            else:
                target.copy_(params[name])
        was, self.version = self.version, record.version
        self.base = params
        self.published = None
        self.nonfinite = 0
        if was < 0:
            return record
        # A row per version adopted (the trackers' rounds are versions): the rounds trained since the last
        # one, the last one's figures first, and the digest of the global now held.
        row: dict[str, Any] = {**(self.sent[-1] if self.sent else {}), "time": time.time()}
        row.update(version=record.version, contributions=[r["contribution"] for r in self.sent])
        if self.config.diloco.verify_global:
            row["global_sha256"] = digest(params)
        self.reporter.round(record.version, row)
        self.sent = []
        self.log.info("adopted global version %d (held %d)", record.version, was)
        return record

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
