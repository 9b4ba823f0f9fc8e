"""``ObjectStoreManager``: the part of torchft's ``Manager`` that ``torchft.local_sgd.DiLoCo`` uses, over a store.

torchft's DiLoCo (Streaming fragments, overlap tau, the alpha merge) stays unchanged; only the transport
differs. DiLoCo calls, per fragment sync: ``start_quorum()``, ``current_step()`` (to pick the fragment),
``allreduce(delta)`` (we get one flat bucket per fragment: the trainer enables torchft's bucketization with
a cap that holds the whole fragment), then, ``fragment_sync_delay`` inner steps later, ``work.wait()`` and
``should_commit()``.

``allreduce`` copies the bucket to host memory (asynchronously from an accelerator), starts the exchange
(``allreduce.py``) on a background thread and returns at once, so with ``fragment_sync_delay >= 1`` the store
round trip runs behind inner steps (Streaming DiLoCo's overlap). The thread works on host memory only; the
average lands in the bucket when DiLoCo waits for the Work, on DiLoCo's own thread and stream, and only then
does the Work's future complete, because torchft's bucketized path unpacks the bucket in a ``.then`` callback
of that future.

Failures are reported, not raised, as with torchft's own Manager: ``should_commit()`` returns False and
DiLoCo restores the last global parameters. ``current_step()`` counts the syncs whose result this replica
took from the store; it starts from the store's latest published state, and sync ``s`` lives under
``rounds/{s // fragments + 1}/{s % fragments}``. Every replica that commits sync ``s`` applied the same
reduced shards, so steps and parameters agree across replicas; a replica whose sync failed retries it (and
finds the reduced shards already there) or catches up from the store's latest state.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torchft.work import _DummyWork

from composer_serverless.rendezvous import layout, recovery
from composer_serverless.rendezvous.allreduce import allreduce
from composer_serverless.rendezvous.deadline import ArrivalHistory, GraceSettings
from composer_serverless.rendezvous.exchange import ExchangeResult, ExchangeSettings, StaleRoundError
from composer_serverless.rendezvous.feedback import ErrorFeedback, Residuals
from composer_serverless.rendezvous.latest import latest_round, newest_round
from composer_serverless.rendezvous.replica_log import ReplicaLog
from composer_serverless.rendezvous.rows import RowMask
from composer_serverless.rendezvous.sharding import shard_bounds
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.workspace import Workspace

logger = logging.getLogger(__name__)


@dataclass
class SyncOutcome:
    """What happened in one fragment sync on this replica."""

    round: int
    fragment: int
    committed: bool = False
    participants: list[int] = field(default_factory=list)
    # Participants with an input left out of the average (malformed, non-finite): not averaged in this sync.
    rejected: list[int] = field(default_factory=list)
    contributed: bool = False
    upload_failed: bool = False
    error: Exception | None = None

    @property
    def late(self) -> bool:
        """This replica arrived after the quorum was fixed (as opposed to failing to upload)."""
        return self.committed and not self.contributed and not self.upload_failed


@dataclass
class _Sync:
    outcome: SyncOutcome
    exchanged: bool = False
    thread: threading.Thread | None = None
    land: Callable[[], None] = lambda: None
    # With error feedback, the residuals the exchange left: kept if the sync commits (the inputs' only if they
    # were averaged).
    residual: Residuals | None = None
    carried: float | None = None  # and the share of what the inputs were to send that they carried
    # The [start, end) spans of the shards whose average holds this replica's input: where the residual moves.
    averaged: list[tuple[int, int]] = field(default_factory=list)


class _ExchangeWork(dist._Work):
    """A Work whose exchange runs on a thread. ``wait`` joins it, books the time the caller was blocked, and
    lands the average: on the caller's thread (and stream), so the exchange thread never touches device
    memory."""

    def __init__(
        self,
        thread: threading.Thread,
        land: Callable[[], None],
        future: torch.futures.Future,
        manager: ObjectStoreManager,
    ) -> None:
        super().__init__()
        self._thread = thread
        self._land = land
        self._future = future
        self._manager = manager

    def wait(self, timeout: timedelta | None = None) -> bool:
        started = time.monotonic()
        self._thread.join(None if timeout is None else timeout.total_seconds())
        self._manager.blocked_s += time.monotonic() - started
        if self._thread.is_alive():
            return False
        self._land()
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future


class ObjectStoreManager:
    """Duck-types ``torchft.manager.Manager`` for ``DiLoCo`` with an object-store all-reduce.

    Args:
        store: the run's store.
        run_id: written into every payload header, so objects of another run are never averaged.
        rank: this replica's rank in ``[0, settings.replicas)``.
        fragments: number of DiLoCo fragments; sync ``s`` carries fragment ``s % fragments``.
        settings: replicas, min_replicas, codec and timeout of every exchange.
        grace: bounds of the adaptive wait for stragglers.
        agree: for a replica of several ranks (``settings.local_ranks``), called by ``should_commit`` on every
            rank with whether its own part committed; returns whether all did. A replica commits a sync on all
            of its ranks or on none, as torchft's Manager decides for a replica group.
        rows: called with the fragment of each sync, on the thread that starts it, for the token-indexed
            rows of its bucket and when this replica trained on each token (``rows.py``); None, or a None
            answer, averages every value plainly.
        feedback: the residuals of error feedback (``feedback.py``), for a lossy codec that drops much (the
            sparse one): a sync that commits keeps what its inputs left out (if they were averaged; the local
            weights restart from the global ones minus it, ``host_diloco.py``) and what the average this
            replica published as its shard's owner left out. None: no feedback.
    """

    # DiLoCo refuses an asynchronous quorum; ours is decided inside each exchange.
    _use_async_quorum = False

    def __init__(
        self,
        store: ObjectStore,
        *,
        run_id: str,
        rank: int,
        fragments: int,
        settings: ExchangeSettings,
        grace: GraceSettings,
        agree: Callable[[bool], bool] = lambda committed: committed,
        rows: Callable[[int], RowMask | None] | None = None,
        feedback: ErrorFeedback | None = None,
    ) -> None:
        if not 0 <= rank < settings.replicas:
            raise ValueError(f"rank {rank} is outside [0, {settings.replicas})")
        self._store = store
        self._run_id = run_id
        self._rank = rank
        self._log = ReplicaLog(logger, rank, settings.local_rank if settings.local_ranks > 1 else None)
        self._agree = agree
        self._rows = rows
        self.feedback = feedback
        self._fragments = fragments
        self._settings = settings
        self._arrivals = ArrivalHistory(grace)
        self._workspace = Workspace()  # syncs run one at a time: should_commit() joins each exchange
        self._step = 0
        self._sync: _Sync | None = None
        self._state_fns: dict[str, tuple[Callable[[Any], None], Callable[[], Any]]] = {}
        self._staging: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self.last_sync: SyncOutcome | None = None
        self.syncs_attempted = 0
        self.bytes_up = 0
        self.bytes_down = 0
        self.blocked_s = 0.0
        # With error feedback, over the committed syncs whose inputs were averaged: the sum of the shares of
        # what the inputs were to send that they carried, and how many (the meter reports their mean per round).
        self.carried_total = 0.0
        self.carried_syncs = 0

    # --- the interface DiLoCo uses -------------------------------------------------------------------

    def start_quorum(self) -> None:
        """Open sync ``current_step()``; its participants are fixed inside the exchange, in the store."""
        round_index, fragment = self.sync_position(self._step)
        self._sync = _Sync(SyncOutcome(round_index, fragment))

    def current_step(self) -> int:
        """Number of syncs whose result this replica took from the store."""
        return self._step

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False) -> dist._Work:
        """Start averaging ``tensor`` in place across the quorum; errors are recorded for ``should_commit``."""
        del should_quantize  # the run's wire codec decides compression, not torchft's Triton path
        if self._sync is None:
            self.start_quorum()
        sync = self._sync
        assert sync is not None
        if sync.exchanged:
            sync.outcome.error = RuntimeError(
                "ObjectStoreManager got a second allreduce in one sync; build DiLoCo with "
                "use_bucketization=True and a bucket_cap_mb that holds a whole fragment"
            )
            return _DummyWork(tensor)
        sync.exchanged = True
        values, copied = self._to_host(tensor)
        rows = self._rows(sync.outcome.fragment) if self._rows is not None else None
        residual = None
        if self.feedback is not None:
            start, end = shard_bounds(values.numel(), self._settings.replicas)[self._rank]
            residual = self.feedback.to_send(sync.outcome.fragment, values.numel(), end - start)
        future: torch.futures.Future = torch.futures.Future()
        sync.thread = threading.Thread(
            target=self._exchange,
            args=(values, copied, sync.outcome, rows, residual, sync),
            name=f"exchange-{sync.outcome.round}-{sync.outcome.fragment}",
            daemon=True,
        )
        sync.thread.start()

        def land() -> None:
            """Once: the average into ``tensor`` (when it is not ``values`` itself), then the future, whose
            torchft callback unpacks the bucket. On failure it unpacks a tensor that may hold part of the
            average, which DiLoCo discards because should_commit() is False."""
            if future.done():
                return
            if values.data_ptr() != tensor.data_ptr():
                tensor.copy_(values.view_as(tensor))
            future.set_result(tensor)

        sync.land = land
        return _ExchangeWork(sync.thread, land, future, self)

    def _to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """The values to exchange, in host memory: ``tensor`` itself when it is a CPU fp32 tensor (the
        average is written into it), else a copy. From an accelerator the copy goes into a pinned buffer kept
        for the next sync, without blocking the caller (it runs on the caller's stream, behind the kernels
        that computed ``tensor``); the event says when it has landed, and the exchange thread waits for it
        before reading."""
        flat = tensor.detach().reshape(-1)
        if flat.device.type == "cpu":
            return flat.to(torch.float32), None
        key = (flat.numel(), flat.dtype)
        staging = self._staging.get(key)
        if staging is None:  # one per fragment shape: pinning memory is slow, so it is done once
            staging = self._staging[key] = torch.empty(key[0], dtype=flat.dtype, pin_memory=True)
        staging.copy_(flat, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return staging, copied

    def should_commit(self) -> bool:
        """True if this sync's average came from the store; advances ``current_step()`` only then."""
        sync, self._sync = self._sync, None
        if sync is None:
            raise RuntimeError("should_commit() without start_quorum()")
        if sync.thread is not None:
            sync.thread.join()
            sync.land()
        outcome = sync.outcome
        mine = sync.exchanged and outcome.error is None
        outcome.committed = self._agree(mine)
        if mine and not outcome.committed:
            outcome.error = RuntimeError("another rank of this replica failed its part of the sync")
        if outcome.committed:
            self._step += 1
            averaged = outcome.contributed and self._rank not in outcome.rejected
            if self.feedback is not None and sync.residual is not None:
                self.feedback.keep(
                    outcome.fragment,
                    sync.residual.inputs if outcome.contributed else None,
                    sync.residual.owned,
                    sync.averaged,
                )
            if averaged and sync.carried is not None:
                self.carried_total += sync.carried
                self.carried_syncs += 1
        self.syncs_attempted += 1
        self.last_sync = outcome
        if outcome.committed:
            self._log.info(
                "round %d fragment %d committed, participants %s",
                outcome.round,
                outcome.fragment,
                outcome.participants,
            )
        else:
            self._log.warning(
                "round %d fragment %d FAILED: %s",
                outcome.round,
                outcome.fragment,
                outcome.error,
            )
        return outcome.committed

    def register_state_dict_fn(
        self, key: str, load_fn: Callable[[Any], None], save_fn: Callable[[], Any]
    ) -> None:
        self._state_fns[key] = (load_fn, save_fn)

    def allow_state_dict_read(self) -> None:
        """No peer reads this replica's memory (state travels through the store), so there is nothing to lock."""

    def disallow_state_dict_read(self) -> None:
        """See ``allow_state_dict_read``."""

    # --- for the trainer ----------------------------------------------------------------------------

    def sync_position(self, step: int) -> tuple[int, int]:
        """(round, fragment) of sync ``step``: rounds count from 1, as in ``rounds/{k}`` and ``state/{k}``."""
        return step // self._fragments + 1, step % self._fragments

    def set_step(self, step: int) -> None:
        """Continue from sync ``step`` (after loading a published state); only between syncs."""
        if self._sync is not None:
            raise RuntimeError("cannot move the step while a sync is open")
        self._step = step

    def user_state_dict(self) -> dict[str, Any]:
        """What DiLoCo registered: per fragment, the global parameters and the outer optimizer state."""
        return {key: save_fn() for key, (_, save_fn) in self._state_fns.items()}

    def load_user_state_dict(self, state: dict[str, Any]) -> None:
        """Load what ``user_state_dict`` returned (from a published state) into DiLoCo's fragments."""
        if set(state) != set(self._state_fns):
            raise ValueError(f"state has fragments {sorted(state)}, this model has {sorted(self._state_fns)}")
        for key, (load_fn, _) in self._state_fns.items():
            load_fn(state[key])

    # --- the exchange thread ------------------------------------------------------------------------

    def _exchange(
        self,
        staged: torch.Tensor,
        copied: torch.cuda.Event | None,
        outcome: SyncOutcome,
        rows: RowMask | None = None,
        residual: Residuals | None = None,
        sync: _Sync | None = None,
    ) -> None:
        """Average ``staged`` (host memory) across the quorum, in place, once its copy has landed; with
        ``residual``, the new one goes to ``sync``. Never raises: errors go to ``outcome``, for
        ``should_commit``."""
        try:
            if copied is not None:
                copied.synchronize()
            values = staged.to(torch.float32)  # the staged values themselves when they are fp32
            grace_s = self._arrivals.grace_s()
            result: ExchangeResult = allreduce(
                self._store,
                values,
                prefix=layout.sync(outcome.round, outcome.fragment),
                identity={
                    "run_id": self._run_id,
                    "round": str(outcome.round),
                    "fragment": str(outcome.fragment),
                },
                rank=self._rank,
                settings=self._settings,
                grace_s=grace_s,
                # Completed already: published, or the run has moved past it (its objects may be pruned).
                is_stale=lambda: (
                    latest_round(self._store) >= outcome.round or newest_round(self._store) > outcome.round
                ),
                out=values,  # the average replaces the pseudo-gradient, as an all-reduce does
                absent=frozenset(recovery.given_up(self._store)),
                workspace=self._workspace,
                rows=rows,
                residual=residual,
            )
            if sync is not None:
                sync.residual = result.residual
                sync.carried = result.carried
                bounds = shard_bounds(values.numel(), self._settings.replicas)
                sync.averaged = [
                    bounds[shard] for shard, ranks in sorted(result.summed.items()) if self._rank in ranks
                ]
            if values.data_ptr() != staged.data_ptr():
                staged.copy_(values)
            outcome.participants = result.participants
            outcome.rejected = sorted(set(result.participants) - set(result.contributors))
            outcome.contributed = self._rank in result.participants
            outcome.upload_failed = result.upload_failed
            if result.waited_for_all_s is not None:
                self._arrivals.observe(result.waited_for_all_s)
            self.bytes_up += result.bytes_up
            self.bytes_down += result.bytes_down
        except Exception as e:  # reported through should_commit, as torchft's Manager does
            if isinstance(e, StaleRoundError):
                self._log.info("%s", e)
            else:
                self._log.exception(
                    "round %d fragment %d exchange failed",
                    outcome.round,
                    outcome.fragment,
                )
            outcome.error = e
