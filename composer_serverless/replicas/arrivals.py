"""A decoupled learner's reader of newer global versions, in the background (``adopt_when = "arrival"``).

Decoupled DiLoCo's learners never block on one another or on the syncer, but reading a global version takes
time: the whole parameters, checked against their manifest (seconds for a small model from a local store,
minutes for an 8B one over a cloud link). So the learner's lead reads them on a thread while its inner steps
run, and the learner adopts what this thread has read at its next inner-step boundary
(``DecoupledLearner._adopt_arrived``), without waiting for anything.

The thread reads one version at a time, the newest listed: a version newer than the one it holds ready
replaces it (the learner always adopts the newest it can have now; a version passed over was never
needed). It keeps at most one version ready in host memory, and one being read. A version whose snapshots
do not read whole (damaged after its commit, ``CheckpointError``) is passed over with a warning, as the
learner's own reading does (``_adopt_newest``): the next one the syncer commits is read instead. Any other
exception stops the thread and is raised in the learner, by its next ``take``: nothing fails silently. The
thread is a daemon and ``close`` (the context manager's exit) stops and joins it, so it never outlives the
learner's loop.
"""

from __future__ import annotations

import logging
import threading
from types import TracebackType

import torch

from composer_serverless.rendezvous import decoupled as store_versions
from composer_serverless.rendezvous.checkpoint import CheckpointError
from composer_serverless.rendezvous.decoupled import Version
from composer_serverless.rendezvous.latest import newest_version
from composer_serverless.rendezvous.runkey import RunKey
from composer_serverless.rendezvous.store import ObjectStore

log = logging.getLogger(__name__)

Arrived = tuple[Version, dict[str, torch.Tensor]]


class Arrivals:
    """Reads each newer global version than ``held`` into host memory, on a thread, for ``take``."""

    def __init__(self, store: ObjectStore, key: RunKey | None, held: int, poll_s: float) -> None:
        self._store = store
        self._key = key
        self.poll_s = poll_s  # seconds between listings: the learner sets it as it learns its step time
        self._lock = threading.Lock()
        self._floor = held  # versions at or below it are not read: held, ready, or passed over
        self._ready: Arrived | None = None
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="decoupled-arrivals", daemon=True)

    def __enter__(self) -> Arrivals:
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop the thread and wait for it (a read in progress finishes first)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def take(self, held: int) -> Arrived | None:
        """The newest version read since the last call and newer than ``held`` (the version the learner holds
        now), with its parameters; None if there is none. Never waits for a read.

        Raises:
            Exception: what stopped the thread (a store error, a bug), here in the learner.
        """
        with self._lock:
            if self._error is not None:
                raise self._error
            ready, self._ready = self._ready, None
            self._floor = max(self._floor, held)
        return ready if ready is not None and ready[0].version > held else None

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                newest = newest_version(self._store)
                with self._lock:
                    floor = self._floor
                if newest > floor:
                    self._read(newest)
                else:
                    self._stop.wait(self.poll_s)
        except BaseException as e:  # raised in the learner by its next take
            with self._lock:
                self._error = e

    def _read(self, newest: int) -> None:
        store = self._store
        try:
            record, params = store_versions.read_or_newer(
                store,
                store_versions.read_version(store, newest),
                lambda r: store_versions.load_params(store, r, self._key),
            )
        except (CheckpointError, FileNotFoundError) as e:
            log.warning("global version %d cannot be read, passed over: %s", newest, e)
            with self._lock:
                self._floor = max(self._floor, newest)
            return
        with self._lock:
            if record.version > self._floor:
                self._ready, self._floor = (record, params), record.version
