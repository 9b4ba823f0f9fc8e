"""Reduce-scatter + all-gather of one flat fp32 tensor through the object store, with a quorum.

(A little over 400 lines: the four phases below share one exchange's state, ``_Exchange``, and read best
together; the pure parts are in ``sharding.py`` and ``workspace.py``, the types it shares with its callers
in ``exchange.py``.)

The tensor is cut into N contiguous shards; shard s is owned by rank s. Per sync, under ``{prefix}/``:

1. **Scatter.** Each replica uploads its N encoded shards as ``in/{rank}-{shard}`` (create-if-absent, so an
   input is immutable once written).
2. **Quorum.** The participants are fixed once, in ``quorum.json`` (create-if-absent; everyone reads the
   single winner), by whichever replica first sees either all N inputs complete or its grace deadline
   passed with at least ``min_replicas`` complete. The grace adapts to observed arrivals (``deadline.py``).
3. **Reduce.** The owner of shard s sums the decoded inputs of shard s in rank order, in fp32, divides by
   the number of inputs summed, encodes the result and creates ``out/{s}``. A shard whose owner is not a
   participant goes to a substitute participant; a shard still missing after a deadline is reduced by
   whichever replica is waiting for it. Every reducer sums the same durable bytes in the same order, so
   whoever wins the create, the content is the same.
4. **Gather.** Everyone reads the reduced shards it did not write. Every replica, the owner included, uses
   the *decoded* reduced shard, so with a lossy codec all replicas still end bit-identical.

Per replica that is an upload of about S_wire (its N inputs, plus the reduced shard it owns, S_wire/N) and a
download of 2(N-1)/N * S_wire (N-1 peer inputs of its shard, N-1 reduced shards): the bandwidth-optimal
all-reduce bound. A replica that is not a participant (it arrived after the quorum was fixed) uploads
nothing and reads all N reduced shards: it receives the participants' average exactly as torchft's healing
replicas do (they contribute zeros and receive the average).

With a ``RowMask`` (``rows.py``) each input also carries, per row of the token-indexed blocks (the embedding,
an untied head) its shard overlaps, a bit per step bucket of the window: whether the replica's data held that
token then. The reducer combines each such row over the inputs whose data held the token, where any did
(``rows.RowSums``): a few bytes per row, and the average is still a function of the durable inputs alone.

With residuals (error feedback, ``feedback.py``) a replica sends its pseudo-gradient plus its inputs'
residual (none when its local weights keep it), and the result holds what the codec left out of that. With
the sparse codec the owner re-sparsifies the average it publishes (``ExchangeSettings.reduced_codec`` may name
a dense codec instead), so every object of a sync has the sparse payload's size and the traffic stays at the
bound above, for the sparse size; the owner adds its own residual to the average it encodes and keeps what the
encoding left out. A substitute or rescuer publishes without one: its output is still one average every
replica applies alike, whoever wrote it.

A payload that fails its checksum (with a run key, its MAC), header or identity is logged and left out of
the sum, never averaged; so is one whose pseudo-gradient's norm lies far outside the others' (``robust.py``,
with ``outlier_factor``): judged on the norm each replica published once for the sync (``norms.py``,
``norm/{rank}.json``, created before its first input), the same numbers for every shard's owner.

Each phase moves its objects ``store.transfers.concurrency`` at a time (``ObjectStore.map``): a cloud store
gives each connection a fraction of its bandwidth, so a replica moving one shard at a time would be capped at
one connection's speed. The sums stay in rank order whatever order the reads finish in.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable

import torch

from composer_serverless.rendezvous import layout, norms, polling
from composer_serverless.rendezvous.codec import (
    NORM,
    Payload,
    PayloadError,
    accumulate,
    decode,
    encode_parts,
    l2_norm,
    max_payload_bytes,
    measure,
    read_header,
)
from composer_serverless.rendezvous.exchange import (
    ExchangeError,
    ExchangeResult,
    ExchangeSettings,
    StaleRoundError,
)
from composer_serverless.rendezvous.feedback import Residuals, carried_share
from composer_serverless.rendezvous.polling import poll_until
from composer_serverless.rendezvous.replica_log import ReplicaLog
from composer_serverless.rendezvous.robust import outliers
from composer_serverless.rendezvous.rows import RowMask, RowSums, span_rows, spans
from composer_serverless.rendezvous.sharding import (
    MAX_QUORUM_GENERATIONS,
    complete_ranks,
    parse_participants,
    shard_bounds,
    substitute_for,
)
from composer_serverless.rendezvous.store import ObjectStore, ObjectTooLarge
from composer_serverless.rendezvous.transfers import ObjectChanged
from composer_serverless.rendezvous.workspace import Workspace

logger = logging.getLogger(__name__)

REDUCED = "reduced"


def allreduce(
    store: ObjectStore,
    values: torch.Tensor,
    *,
    prefix: str,
    identity: dict[str, str],
    rank: int,
    settings: ExchangeSettings,
    grace_s: float,
    is_stale: Callable[[], bool] | None = None,
    out: torch.Tensor | None = None,
    workspace: Workspace | None = None,
    rows: RowMask | None = None,
    residual: Residuals | None = None,
    absent: frozenset[int] = frozenset(),
) -> ExchangeResult:
    """Average ``values`` (flat fp32) over the quorum of this sync; see the module docstring.

    Args:
        store: the run's store.
        values: this replica's flat fp32 tensor; not modified unless it is ``out``.
        prefix: the sync's prefix, ``layout.sync(k, fragment)``.
        identity: header fields every payload of this sync carries (run id, round, fragment).
        rank: this replica's rank.
        settings: replicas, min_replicas, codec, timeout.
        grace_s: how long after arriving this replica waits for stragglers before fixing a quorum.
        is_stale: asked before this replica fixes a quorum; True means the store has completed this round
            already (its exchange objects may be pruned), so the quorum must not be created again.
        out: a contiguous fp32 CPU tensor of ``values``' size to write the average into (the result's
            ``average`` is then ``out``), instead of a new one: a caller that keeps its buffer saves an
            allocation of the model's size per sync, and its page faults. It may be ``values`` itself: a
            shard of ``out`` is written only after this replica's last read of its own input of that shard.
            On an error ``out`` may hold part of the average.
        workspace: buffers to reuse from the caller's previous syncs; fresh ones if None.
        rows: the token-indexed blocks of ``values`` and in which step buckets this replica's data held each
            token, to combine those rows over the replicas that trained them (``rows.py``); every replica of a
            sync passes the same blocks and buckets. None: a plain average everywhere.
        residual: the residuals of error feedback (``feedback.py``): ``inputs`` (None when the local weights
            hold it) is added to ``values`` before encoding, ``owned``, what the averages this replica
            published as its shard's owner left out, to its shard's average; neither is modified. The
            result's ``residual`` holds what the inputs left out of what they were to send and the new
            ``owned`` (None unless this replica published its shard). None: no error feedback.
        absent: replicas not expected (the launcher gave them up): once every other one has arrived, the
            quorum is fixed without waiting out the grace for them.

    Raises:
        StaleRoundError: ``is_stale`` said so when this replica was about to fix the quorum.
        ExchangeError: no quorum of ``min_replicas`` or no complete result within ``settings.timeout_s``.
    """
    workspace = workspace or Workspace()
    if not workspace.busy.acquire(blocking=False):
        raise RuntimeError(
            "this workspace is in use by another exchange; give each concurrent exchange its own"
        )
    try:
        return _Exchange(
            store,
            values,
            prefix,
            identity,
            rank,
            settings,
            grace_s,
            is_stale,
            out,
            workspace,
            rows,
            residual,
            absent,
        ).run()
    finally:
        workspace.busy.release()


class _Exchange:
    """One replica's part in one sync: the state the phases share."""

    def __init__(
        self,
        store: ObjectStore,
        values: torch.Tensor,
        prefix: str,
        identity: dict[str, str],
        rank: int,
        settings: ExchangeSettings,
        grace_s: float,
        is_stale: Callable[[], bool] | None,
        out: torch.Tensor | None,
        workspace: Workspace,
        rows: RowMask | None = None,
        residual: Residuals | None = None,
        absent: frozenset[int] = frozenset(),
    ) -> None:
        self.store = store.child(prefix)
        self.is_stale = is_stale
        self.values = values.detach().reshape(-1).to(torch.float32)
        # With error feedback, what is to be sent (the values plus the inputs' residual, summed into a buffer
        # kept between syncs: fragment-sized, it is the largest thing an exchange would otherwise allocate
        # anew), and what of it the encoded inputs leave out (the inputs' new residual, which the caller keeps).
        kept = None if residual is None else residual.inputs
        self.sending = (
            self.values
            if kept is None
            else torch.add(
                self.values, kept.reshape(-1), out=workspace.floats("sending", self.values.numel())
            )
        )
        self.unsent = None if residual is None else torch.empty_like(self.values)
        self.owned = None if residual is None else residual.owned
        self.reduced_codec = settings.reduced_codec or settings.codec
        self.identity = identity
        self.rank = rank
        self.local = settings.local_rank
        self.log = ReplicaLog(logger, rank, settings.local_rank if settings.local_ranks > 1 else None)
        self.settings = settings
        self.n = settings.replicas
        self.expected = set(range(self.n)) - absent  # arrived all, these: no straggler to wait for
        self.grace_s = grace_s
        self.started = time.monotonic()
        self.quorum_at = self.started
        self.generation = 0  # of the quorum record (layout.quorum_generation)
        self.hard_deadline = self.started + settings.timeout_s
        self.bounds = shard_bounds(self.values.numel(), self.n)
        self.rows = rows
        self.spans = [spans(rows.blocks, *b) if rows else [] for b in self.bounds]
        # How many row bits each shard's inputs carry: each row's step buckets.
        self.row_bits = [span_rows(s) * (rows.buckets if rows else 0) for s in self.spans]
        # This replica's inputs as written (header, then a view of ``values`` for fp32), kept for reducing.
        self.mine: dict[int, list[memoryview]] = {}
        self.fetched: dict[tuple[int, int], memoryview] = {}
        self.workspace = workspace
        self.key = settings.key
        # With the outlier rule, per participant: the norm it published for this local rank's part, and the
        # one it is judged on (all its parts'), or why it has none; read once, for every shard reduced here.
        self.published: dict[int, float] | None = None
        self.judged: dict[int, float | str] = {}
        self._counting = threading.Lock()  # transfers run on several threads and all add to the byte counts
        if out is None:
            out = torch.empty(self.values.numel())
        elif (
            out.dtype != torch.float32
            or out.device.type != "cpu"
            or not out.is_contiguous()
            or out.numel() != self.values.numel()
        ):
            raise ValueError(
                f"out must be a contiguous fp32 CPU tensor of {self.values.numel()} values, got {out.dtype} "
                f"{out.device} {tuple(out.shape)}"
            )
        self.result = ExchangeResult(average=out.view(-1), participants=[])

    def run(self) -> ExchangeResult:
        quorum = self._read_quorum()
        if quorum is None:
            self._scatter()
            quorum = self._await_quorum()
        elif self.unsent is not None and self.rank in quorum:
            # A retry of a sync whose quorum an earlier attempt of this replica joined: its stored inputs are
            # what the sync averages, so they are what the residual accounts for.
            self.store.map(self._unsent_after_stored, list(range(self.n)))
            self._keep_unsent(l2_norm(self.sending))
        participants = quorum
        self.quorum_at = time.monotonic()
        self.result.participants = participants
        done: set[int] = set()
        if self.rank in participants:
            assigned = [self.rank] + [
                s
                for s in range(self.n)
                if s not in participants and substitute_for(s, participants) == self.rank
            ]
            for shard in assigned:
                self._reduce(shard, participants)
                done.add(shard)
        self._gather(participants, done)
        return self.result

    # --- phase 1: scatter --------------------------------------------------------------------------

    def _scatter(self) -> None:
        """Upload all N shards, ``concurrency`` at a time; the own shard last, since only a rescuer ever
        reads it.

        Each is written from its parts (header, tensor memory) without joining them first: on a box where
        replicas share cores, that copy of the whole pseudo-gradient was CPU the exchange waited for.
        """
        order = [(self.rank + i) % self.n for i in range(1, self.n + 1)]

        # The whole pseudo-gradient's norm, in every input's header: each shard's owner compares whole
        # contributions (``robust.py``), and sees only its shard of each. With the outlier rule it is the
        # number published for this sync (``norms.py``): a retry states the one its first attempt published.
        norm = l2_norm(self.sending)
        whole = repr(norm)

        def upload(shard: int) -> None:
            start, end = self.bounds[shard]
            identity = {**self._input_identity(self.rank, shard), NORM: whole}
            bits = self.rows.bits(self.spans[shard]) if self.rows else None
            parts = encode_parts(self.sending[start:end], identity, self.settings.codec, self.key, bits)
            if self.store.create(layout.sync_input(self.rank, shard, self.local), parts):
                self._count(up=sum(len(p) for p in parts))
                self.mine[shard] = parts
                if self.unsent is not None:
                    self._unsent_after(shard, parts, verify=False)
            else:
                # An earlier attempt at this sync (before a restart or a rollback) already wrote this input;
                # inputs are immutable, so the stored bytes are the ones that count, for the average and for
                # what the residual keeps.
                self.log.info(
                    "input %s exists from an earlier attempt; using the stored one",
                    layout.sync_input(self.rank, shard, self.local),
                )
                if self.unsent is not None:
                    self._unsent_after_stored(shard)

        try:
            if self.settings.outlier_factor is not None:
                whole = repr(self._publish_norm(norm))
            self.store.map(upload, order)
            if self.unsent is not None:
                self._keep_unsent(norm)
        except (
            Exception
        ) as e:  # a replica that cannot upload still receives the average, as a non-participant
            self.result.upload_failed = True
            self.log.warning("upload failed (%s: %s); continuing without contributing", type(e).__name__, e)

    def _publish_norm(self, norm: float) -> float:
        """Publish ``norm`` as this replica's for this sync, before any input states it, and return the
        number its inputs state: the one an earlier attempt of this sync published, if there is one."""
        key = layout.sync_norm(self.rank, self.local)
        identity = self._norm_identity(self.rank)
        written = norms.record(norm, identity, self.key)
        if self.store.create(key, written):
            self._count(up=len(written))
            return norm
        raw = self.store.get(key)
        self._count(down=len(raw))
        stated = norms.parse(raw, identity, self.key)
        if isinstance(stated, str):
            self.log.warning(
                "own norm record %s is unusable (%s); every shard will leave this replica's inputs out",
                key,
                stated,
            )
            return norm
        if stated != norm:
            self.log.info(
                "an earlier attempt at this sync published norm %.6g; stating it, not this attempt's %.6g",
                stated,
                norm,
            )
        return stated

    def _unsent_after(self, shard: int, payload: Payload | None, *, verify: bool) -> None:
        """What this replica's input of ``shard`` (``payload``, as stored) left out of what it was to send
        into ``unsent``: all of it when there is no readable payload (a sync never averages that input)."""
        start, end = self.bounds[shard]
        if payload is not None:
            try:
                sent = decode(
                    payload,
                    self._input_identity(self.rank, shard),
                    self.settings.codec,
                    end - start,
                    verify=verify,
                    key=self.key,
                    rows=self.row_bits[shard],
                )
            except PayloadError as e:
                self.log.warning("own stored input of shard %d is unreadable (%s)", shard, e)
            else:
                torch.sub(self.sending[start:end], sent, out=self.unsent[start:end])
                return
        self.unsent[start:end].copy_(self.sending[start:end])

    def _unsent_after_stored(self, shard: int) -> None:
        """``_unsent_after`` for the input of ``shard`` an earlier attempt of this sync stored."""
        key = layout.sync_input(self.rank, shard, self.local)
        try:
            stored: bytes | None = self.store.get(key)
        except FileNotFoundError:
            stored = None
        else:
            self._count(down=len(stored))
        self._unsent_after(shard, stored, verify=True)

    def _keep_unsent(self, norm: float) -> None:
        self.result.residual = Residuals(self.unsent, None)
        self.result.carried = carried_share(norm, l2_norm(self.unsent))

    # --- phase 2: quorum ---------------------------------------------------------------------------

    def _await_quorum(self) -> list[int]:
        grace_deadline = self.started + self.grace_s
        present: list[int] = []

        def quorum() -> list[int] | None:
            nonlocal present
            keys = set(self.store.list_tree(""))
            present = complete_ranks(keys, self.n, self.settings.local_ranks)
            now = time.monotonic()
            full = self.expected.issubset(present)
            # Observed before looking for the quorum: the last replica to arrive usually finds it fixed
            # already, and its near-zero wait belongs in its history as much as the first one's long wait.
            if full and self.result.waited_for_all_s is None:
                self.result.waited_for_all_s = now - self.started
            if layout.quorum_generation(self.generation) in keys:
                fixed = self._read_quorum()
                if fixed is not None:
                    return fixed
            if self.rank in present:
                self._prefetch(keys, present)
                now = time.monotonic()
            if full or (now >= grace_deadline and len(present) >= self.settings.min_replicas):
                return self._decide(
                    present, "all arrived" if full else f"grace of {self.grace_s:.2f}s passed"
                )
            return None

        fixed = poll_until(quorum, self.hard_deadline)
        if fixed is None:
            raise ExchangeError(
                f"{self.store.url}: only {len(present)}/{self.n} replicas arrived within "
                f"{self.settings.timeout_s:.0f}s; a quorum needs {self.settings.min_replicas}"
            )
        return fixed

    def _decide(self, present: list[int], reason: str) -> list[int]:
        if self.is_stale is not None and self.is_stale():
            raise StaleRoundError(f"{self.store.url}: the store has already completed this round")
        doc = {"participants": present, "decided_by": self.rank, "reason": reason}
        key = layout.quorum_generation(self.generation)
        if self.store.create(key, json.dumps(doc).encode()):
            self.log.info("quorum %s fixed: %s (%s)", self.store.url, present, reason)
            return present
        quorum = self._read_quorum()
        if quorum is None:
            raise ExchangeError(f"{self.store.url}/{key} vanished after it was created")
        return quorum

    def _read_quorum(self) -> list[int] | None:
        """The participants fixed for this sync, or None while there are none. A malformed record is passed
        over for the next generation's (``layout.quorum_generation``), which every reader of it moves to."""
        while True:
            key = layout.quorum_generation(self.generation)
            try:
                raw = self.store.get(key)
            except FileNotFoundError:
                return None
            self._count(down=len(raw))
            participants = parse_participants(raw, self.n)
            if participants is not None:
                return participants
            if self.generation + 1 >= MAX_QUORUM_GENERATIONS:
                raise ExchangeError(
                    f"{self.store.url}/{key} is malformed ({raw[:80]!r}), as is every earlier quorum record of "
                    f"this sync; something overwrites the run's objects. Stop it, then delete "
                    f"{self.store.url}/quorum*.json and resume the run"
                )
            self.log.warning(
                "%s/%s is malformed (%r); using %s instead",
                self.store.url,
                key,
                raw[:80],
                layout.quorum_generation(self.generation + 1),
            )
            self.generation += 1

    def _prefetch(self, keys: set[str], present: list[int]) -> None:
        """While waiting for the quorum, fetch the peer inputs of the shard this replica will reduce."""
        peers = [
            peer
            for peer in present
            if peer != self.rank
            and (peer, self.rank) not in self.fetched
            and layout.sync_input(peer, self.rank, self.local) in keys
        ]
        # One that cannot be read is fetched again when reducing, and rejected there with its reason.
        self._fetch_inputs(peers, self.rank)

    def _fetch_inputs(self, peers: list[int], shard: int) -> dict[int, Exception]:
        """Fetch ``peers``' inputs of ``shard`` into ``self.fetched``, ``concurrency`` at a time, each into a
        buffer of its own; returns why each one that could not be fetched could not."""

        def fetch(peer: int) -> Exception | None:
            try:
                key = layout.sync_input(peer, shard, self.local)
                self.fetched[(peer, shard)] = self._fetch(key, shard, slot=peer)
            except (PayloadError, FileNotFoundError) as e:
                return e
            return None

        failures = self.store.map(fetch, peers)
        return {peer: e for peer, e in zip(peers, failures, strict=True) if e is not None}

    # --- phase 3: reduce ---------------------------------------------------------------------------

    def _reduce(self, shard: int, participants: list[int]) -> None:
        """Sum the participants' inputs of ``shard`` in rank order, publish the average, keep its decoding.

        Every input is checked and measured first; one that fails a check, or whose pseudo-gradient's norm
        lies far outside the others' (``robust.outliers``), is left out with a log line naming it. Then the
        rest is summed from the buffers just checked, without hashing them again."""
        start, end = self.bounds[shard]
        total = self.workspace.floats("total", end - start).zero_()
        missing = [
            peer
            for peer in participants
            if not (peer == self.rank and shard in self.mine) and (peer, shard) not in self.fetched
        ]
        unreadable = self._fetch_inputs(missing, shard)
        inputs: dict[int, Payload] = {}
        if self.settings.outlier_factor is not None and self.published is None:
            self._read_published(participants)
        for peer in participants:
            try:
                if peer in unreadable:
                    raise unreadable[peer]
                payload, verify = self._input(peer, shard)
                identity = self._input_identity(peer, shard)
                stated = measure(
                    payload,
                    identity,
                    self.settings.codec,
                    end - start,
                    verify=verify,
                    key=self.key,
                    rows=self.row_bits[shard],
                ).whole
                if self.settings.outlier_factor is not None:
                    self._check_published(peer, stated)
            except (PayloadError, FileNotFoundError) as e:  # a quorum may name an input that is not there
                self._left_out(peer, shard, str(e))
                continue
            inputs[peer] = payload
        if self.settings.outlier_factor is not None:
            # On the published norms of the quorum's participants: the same numbers for every shard's owner,
            # whichever inputs it could read, so a replica left out is left out of every shard.
            judged = {p: n for p, n in self.judged.items() if not isinstance(n, str)}
            for peer, why in outliers(judged, self.settings.outlier_factor, len(participants)).items():
                if inputs.pop(peer, None) is not None:
                    self._left_out(peer, shard, why)
        if not inputs:
            raise ExchangeError(f"{self.store.url}: no valid input for shard {shard}")
        row_sums = (
            RowSums(self.spans[shard], end - start, self.rows.buckets)
            if self.rows is not None and self.row_bits[shard]
            else None
        )
        for peer, payload in inputs.items():
            identity = self._input_identity(peer, shard)
            values, bits = accumulate(
                total,
                payload,
                identity,
                self.settings.codec,
                verify=False,
                key=self.key,
                rows=self.row_bits[shard],
            )
            if row_sums is not None:
                row_sums.add(values, bits)
        summed = list(inputs)
        total.div_(len(summed))
        if row_sums is not None:
            row_sums.apply(total)
        identity = {**self._reduced_identity(shard), "summed": ",".join(map(str, summed))}
        owned = self.owned is not None and shard == self.rank
        if owned:
            total.add_(self.owned)
        parts = encode_parts(total, identity, self.reduced_codec, self.key)
        if self.store.create(layout.sync_output(shard, self.local), parts):
            self._count(up=sum(len(p) for p in parts))
            self._place(shard, parts, verify=False)
            self.result.summed[shard] = summed
            if owned:  # what the published average left out of the average plus the residual
                left = total.sub_(self.result.average[start:end]).clone()
                self.result.residual = Residuals(
                    self.result.residual.inputs if self.result.residual else None, left
                )
        else:
            self._place(shard, self._fetch(layout.sync_output(shard, self.local), shard, output=True))

    def _check_published(self, peer: int, stated: float) -> None:
        """Raise ``PayloadError`` unless ``peer`` published a usable norm record for every part of its
        pseudo-gradient and its input states the one of this part (``stated``, from the header)."""
        assert self.published is not None
        judged = self.judged[peer]
        if isinstance(judged, str):
            raise PayloadError(f"replica {peer} published no usable norm for this sync: {judged}")
        if stated != self.published[peer]:
            raise PayloadError(
                f"payload states a norm of {stated!r} for the whole pseudo-gradient, but replica {peer} "
                f"published {self.published[peer]!r} for this sync ({layout.sync_norm(peer, self.local)})"
            )

    def _read_published(self, participants: list[int]) -> None:
        """Read every participant's norm records, of each of its local ranks' parts (``norms.py``)."""
        parts = [(peer, local) for peer in participants for local in range(self.settings.local_ranks)]

        def read(part: tuple[int, int]) -> float | str:
            peer, local = part
            key = layout.sync_norm(peer, local)
            try:
                raw = self.store.get(key)
            except FileNotFoundError:
                return f"{key} is missing"
            self._count(down=len(raw))
            parsed = norms.parse(raw, {**self._norm_identity(peer), "local": str(local)}, self.key)
            return parsed if not isinstance(parsed, str) else f"{key}: {parsed}"

        read_norms = dict(zip(parts, self.store.map(read, parts), strict=True))
        self.published = {}
        for peer in participants:
            mine = [read_norms[(peer, local)] for local in range(self.settings.local_ranks)]
            unusable = [why for why in mine if isinstance(why, str)]
            if unusable:
                self.judged[peer] = "; ".join(unusable)
                continue
            self.published[peer] = float(read_norms[(peer, self.local)])
            self.judged[peer] = norms.whole([float(n) for n in mine])

    def _left_out(self, peer: int, shard: int, why: str) -> None:
        self.log.warning(
            "rejected %s/%s (replica %d): %s",
            self.store.url,
            layout.sync_input(peer, shard, self.local),
            peer,
            why,
        )

    def _input(self, peer: int, shard: int) -> tuple[Payload, bool]:
        """The payload of ``peer``'s input for ``shard``, and whether it must be verified (it came from the
        store) or not (this replica encoded it, in this exchange: its parts, read where they lie)."""
        if peer == self.rank and shard in self.mine:
            return self.mine.pop(shard), False
        return self.fetched.pop((peer, shard)), True

    # --- phase 4: gather ---------------------------------------------------------------------------

    def _gather(self, participants: list[int], done: set[int]) -> None:
        pending = set(range(self.n)) - done
        # Reads in flight at once each need a buffer: ``concurrency`` of them, handed from one read to the next.
        buffers: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(self.store.transfers.concurrency):
            buffers.put(slot)

        def place(shard: int) -> None:
            slot = buffers.get()
            try:
                self._place(
                    shard,
                    self._fetch(
                        layout.sync_output(shard, self.local), shard, slot=("out", slot), output=True
                    ),
                )
            finally:
                buffers.put(slot)
            pending.discard(shard)

        def all_placed() -> bool | None:
            available = {
                int(name) for name in self.store.list(layout.sync_outputs(self.local)) if name.isdigit()
            }
            self.store.map(place, sorted(pending & available))
            return None if pending else True

        # Owners start reducing when they see the quorum, up to one poll interval after this replica did:
        # give them that, plus twice as long as this replica took and at least the straggler grace, before
        # doing their work for them.
        now = time.monotonic()
        rescue_at = now + polling.CAP_S + max(self.grace_s, 2 * (now - self.quorum_at))
        if poll_until(all_placed, min(rescue_at, self.hard_deadline)):
            return
        if rescue_at > self.hard_deadline:
            raise ExchangeError(
                f"{self.store.url}: reduced shards {sorted(pending)} missing after {self.settings.timeout_s:.0f}s"
            )
        for shard in sorted(pending):
            self.log.warning(
                "%s/%s missing %.1fs after the quorum; reducing it here",
                self.store.url,
                layout.sync_output(shard, self.local),
                time.monotonic() - self.started,
            )
            self._reduce(shard, participants)
            self.result.rescued.append(shard)

    def _place(self, shard: int, payload: Payload, *, verify: bool = True) -> None:
        start, end = self.bounds[shard]
        identity = self._reduced_identity(shard)
        decode(
            payload,
            identity,
            self.reduced_codec,
            end - start,
            self.result.average[start:end],
            verify=verify,
            key=self.key,
        )
        if verify:  # a reduced shard from the store: its header says whose inputs it averages
            header, _ = read_header(payload[0] if isinstance(payload, list) else payload)
            named = str(header["__metadata__"].get("summed", ""))  # type: ignore[union-attr]
            self.result.summed[shard] = [int(r) for r in named.split(",") if r.isdigit()]

    # --- helpers -----------------------------------------------------------------------------------

    def _fetch(self, key: str, shard: int, *, slot: object = "scratch", output: bool = False) -> memoryview:
        """Read ``key`` into the workspace buffer ``slot``, sized for ``shard``'s input (or, with
        ``output``, reduced) payload. The default slot is for payloads used at once; a payload kept while
        others are read (a prefetched input) gets its own slot."""
        start, end = self.bounds[shard]
        size = (
            max_payload_bytes(end - start, self.reduced_codec)
            if output
            else max_payload_bytes(end - start, self.settings.codec, self.row_bits[shard])
        )
        buffer = self.workspace.bytes(slot, size)
        try:
            size = self.store.get_into(key, buffer)
        except (ObjectTooLarge, ObjectChanged) as e:  # no payload is that large or keeps changing: rejected
            raise PayloadError(str(e)) from e
        self._count(down=size)
        return buffer[:size]

    def _count(self, *, up: int = 0, down: int = 0) -> None:
        with self._counting:
            self.result.bytes_up += up
            self.result.bytes_down += down

    def _input_identity(self, rank: int, shard: int) -> dict[str, str]:
        return {**self.identity, "local": str(self.local), "rank": str(rank), "shard": str(shard)}

    def _norm_identity(self, rank: int) -> dict[str, str]:
        return {**self.identity, "local": str(self.local), "rank": str(rank)}

    def _reduced_identity(self, shard: int) -> dict[str, str]:
        return {**self.identity, "local": str(self.local), "rank": REDUCED, "shard": str(shard)}
