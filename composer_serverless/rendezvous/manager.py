"""``ObjectStoreManager``: the part of torchft's ``Manager`` that ``torchft.local_sgd.DiLoCo`` uses, over a store.

torchft's DiLoCo (Streaming fragments, overlap tau, the alpha merge) stays unchanged; only the transport
differs. DiLoCo calls, per fragment sync: ``start_quorum()``, ``current_step()`` (to pick the fragment),
``allreduce(delta)`` (we get one flat bucket per fragment: the trainer enables torchft's bucketization with
a cap that holds the whole fragment), then, ``fragment_sync_delay`` inner steps later, ``work.wait()`` and
``should_commit()``.

``allreduce`` starts the exchange (``allreduce.py``) on a background thread and returns at once, so with
``fragment_sync_delay >= 1`` the store round trip runs behind inner steps (Streaming DiLoCo's overlap). The
thread writes the average into the tensor and only then completes the Work's future, because torchft's
bucketized path unpacks the buffer in a ``.then`` callback of that future.

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

from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.allreduce import allreduce
from composer_serverless.rendezvous.deadline import ArrivalHistory, GraceSettings
from composer_serverless.rendezvous.exchange import ExchangeResult, ExchangeSettings, StaleRoundError
from composer_serverless.rendezvous.latest import latest_round, newest_round
from composer_serverless.rendezvous.replica_log import ReplicaLog
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


class _ExchangeWork(dist._Work):
    """A Work whose exchange runs on a thread; ``wait`` joins it and books the time the caller was blocked."""

    def __init__(
        self, thread: threading.Thread, future: torch.futures.Future, manager: ObjectStoreManager
    ) -> None:
        super().__init__()
        self._thread = thread
        self._future = future
        self._manager = manager

    def wait(self, timeout: timedelta | None = None) -> bool:
        started = time.monotonic()
        self._thread.join(None if timeout is None else timeout.total_seconds())
        self._manager.blocked_s += time.monotonic() - started
        return not self._thread.is_alive()

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
    ) -> None:
        if not 0 <= rank < settings.replicas:
            raise ValueError(f"rank {rank} is outside [0, {settings.replicas})")
        self._store = store
        self._run_id = run_id
        self._rank = rank
        self._log = ReplicaLog(logger, rank, settings.local_rank if settings.local_ranks > 1 else None)
        self._agree = agree
        self._fragments = fragments
        self._settings = settings
        self._arrivals = ArrivalHistory(grace)
        self._workspace = Workspace()  # syncs run one at a time: should_commit() joins each exchange
        self._step = 0
        self._sync: _Sync | None = None
        self._state_fns: dict[str, tuple[Callable[[Any], None], Callable[[], Any]]] = {}
        self.last_sync: SyncOutcome | None = None
        self.syncs_attempted = 0
        self.bytes_up = 0
        self.bytes_down = 0
        self.blocked_s = 0.0

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
        # A CPU fp32 copy (the tensor itself when it is one), taken here on the caller's thread (and stream),
        # so the exchange thread never touches accelerator memory that DiLoCo may still be writing on a side
        # stream. The exchange writes the average into it.
        values = tensor.detach().reshape(-1).to("cpu", torch.float32)
        future: torch.futures.Future = torch.futures.Future()
        sync.thread = threading.Thread(
            target=self._exchange,
            args=(tensor, values, sync.outcome, future),
            name=f"exchange-{sync.outcome.round}-{sync.outcome.fragment}",
            daemon=True,
        )
        sync.thread.start()
        return _ExchangeWork(sync.thread, future, self)

    def should_commit(self) -> bool:
        """True if this sync's average came from the store; advances ``current_step()`` only then."""
        sync, self._sync = self._sync, None
        if sync is None:
            raise RuntimeError("should_commit() without start_quorum()")
        if sync.thread is not None:
            sync.thread.join()
        outcome = sync.outcome
        mine = sync.exchanged and outcome.error is None
        outcome.committed = self._agree(mine)
        if mine and not outcome.committed:
            outcome.error = RuntimeError("another rank of this replica failed its part of the sync")
        if outcome.committed:
            self._step += 1
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
        self, tensor: torch.Tensor, values: torch.Tensor, outcome: SyncOutcome, future: torch.futures.Future
    ) -> None:
        try:
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
                workspace=self._workspace,
            )
            if values.data_ptr() != tensor.data_ptr():  # else ``values`` is ``tensor`` (CPU fp32): done
                tensor.copy_(values.view_as(tensor))
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
        finally:
            # Completing the future runs torchft's .then callback (which unpacks the bucket), so it comes
            # after the average is in place; on failure it unpacks a tensor that may hold part of the
            # average, which DiLoCo discards because should_commit() is False.
            future.set_result(tensor)
