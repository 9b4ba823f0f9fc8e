"""``ObjectStoreManager``: the part of torchft's ``Manager`` that ``torchft.local_sgd.DiLoCo`` uses, over a store.

torchft's DiLoCo (Streaming fragments, overlap tau, the alpha merge) stays unchanged; only the transport
differs. DiLoCo calls, per fragment sync: ``start_quorum()``, ``current_step()`` (to pick the fragment),
``allreduce(delta)`` (we get one flat bucket per fragment: the trainer enables torchft's bucketization with
a cap that holds the whole fragment), then ``should_commit()``. A failed exchange is reported, not raised:
``should_commit()`` then returns False and DiLoCo restores the last global parameters, as with torchft's
own Manager.

Objects, per sync ``k`` of fragment ``f``: ``rounds/{k}/{f}/in/{rank}-{shard}``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torchft.work import _DummyWork

from composer_serverless.rendezvous.allreduce import naive_allreduce
from composer_serverless.rendezvous.store import ObjectStore

logger = logging.getLogger(__name__)


class ObjectStoreManager:
    """Duck-types ``torchft.manager.Manager`` for ``DiLoCo`` with an object-store all-reduce.

    Args:
        store: the run's store.
        run_id: written into every payload header, so objects of another run are never averaged.
        rank: this replica's rank in ``[0, replicas)``.
        replicas: the fixed set of participants is ``range(replicas)``.
        fragments: number of DiLoCo fragments; sync ``k`` carries fragment ``k % fragments``.
        timeout_s: how long one exchange waits for the other replicas.
    """

    # DiLoCo refuses an asynchronous quorum; ours is always decided before the exchange.
    _use_async_quorum = False

    def __init__(
        self, store: ObjectStore, *, run_id: str, rank: int, replicas: int, fragments: int, timeout_s: float
    ) -> None:
        self._store = store
        self._run_id = run_id
        self._rank = rank
        self._replicas = replicas
        self._fragments = fragments
        self._timeout_s = timeout_s
        self._step = 0
        self._error: Exception | None = None
        self._exchanged = False
        self._state_fns: dict[str, tuple[Callable[[Any], None], Callable[[], Any]]] = {}
        self.bytes_up = 0
        self.bytes_down = 0
        self.blocked_s = 0.0

    # --- the interface DiLoCo uses -------------------------------------------------------------------

    def start_quorum(self) -> None:
        """Open sync ``current_step()``; participants are fixed, so there is nothing to negotiate."""
        self._error = None
        self._exchanged = False

    def current_step(self) -> int:
        """Number of committed syncs; identical on every replica because every replica commits together."""
        return self._step

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False) -> _DummyWork:
        """Average ``tensor`` in place across the replicas; errors are recorded for ``should_commit``."""
        del should_quantize  # the wire codec decides compression, not torchft's Triton path
        if self._exchanged:
            self._error = RuntimeError(
                "ObjectStoreManager got a second allreduce in one sync; build DiLoCo with "
                "use_bucketization=True and a bucket_cap_mb that holds a whole fragment"
            )
            return _DummyWork(tensor)
        self._exchanged = True
        fragment = self._step % self._fragments
        identity = {"run_id": self._run_id, "round": str(self._step), "fragment": str(fragment)}
        started = time.monotonic()
        try:
            # The exchange works on a CPU fp32 copy whatever the parameters' device and dtype; the average is
            # copied back onto the tensor's own device.
            average, stats = naive_allreduce(
                self._store,
                f"rounds/{self._step}/{fragment}",
                tensor.detach().reshape(-1).to("cpu", torch.float32),
                rank=self._rank,
                participants=list(range(self._replicas)),
                identity=identity,
                timeout_s=self._timeout_s,
            )
            tensor.copy_(average.view_as(tensor))
            self.bytes_up += stats.bytes_up
            self.bytes_down += stats.bytes_down
        except Exception as e:  # reported through should_commit, as torchft's Manager does
            logger.exception("[replica %d sync %d] exchange failed", self._rank, self._step)
            self._error = e
        finally:
            self.blocked_s += time.monotonic() - started
        return _DummyWork(tensor)

    def should_commit(self) -> bool:
        """True if this sync's exchange succeeded; advances ``current_step()`` only then."""
        committed = self._error is None and self._exchanged
        if committed:
            self._step += 1
        logger.info("[replica %d] sync %d %s", self._rank, self._step - committed, "committed" if committed else "FAILED")
        return committed

    def register_state_dict_fn(self, key: str, load_fn: Callable[[Any], None], save_fn: Callable[[], Any]) -> None:
        self._state_fns[key] = (load_fn, save_fn)

    def allow_state_dict_read(self) -> None:
        """No peer reads this replica's memory (state travels through the store), so there is nothing to lock."""

    def disallow_state_dict_read(self) -> None:
        """See ``allow_state_dict_read``."""

    # --- for the trainer ----------------------------------------------------------------------------

    @property
    def last_error(self) -> Exception | None:
        return self._error

    def user_state_dict(self) -> dict[str, Any]:
        """What DiLoCo registered: per fragment, the global parameters and the outer optimizer state."""
        return {key: save_fn() for key, (_, save_fn) in self._state_fns.items()}
