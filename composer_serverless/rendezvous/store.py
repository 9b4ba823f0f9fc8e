"""The object store every replica and the launcher share: one fsspec-backed implementation.

Replicas coordinate only through objects, so these properties matter more than speed:

* **Atomic writes.** A reader never sees half an object. S3-like stores give this per PUT; on a local
  filesystem we write a temporary file beside the target and ``os.replace`` it.
* **Create-if-absent.** Objects two replicas could both write (quorums, reduced shards, ``run.json``) are
  created exactly once: ``os.link`` locally, ``If-None-Match: *`` on S3 (s3fs ``mode="create"``). Some
  S3-compatible servers accept the header and overwrite anyway, so ``ensure_root`` probes it at start-up.
* **Fresh listings.** fsspec caches directory listings by default, which makes a barrier wait forever on
  stale data; every filesystem here is built with the listing cache off and its own instance.
* **Bounded retries.** Transient failures (5xx, throttling, timeouts, dropped connections, S3's 409 on
  concurrent conditional writes) are retried with jittered exponential backoff, each retry logged; a
  missing object, a lost create race or a denied request is an answer, not a fault, and is never retried.
  On S3 this is the only retry layer (botocore's and s3fs's are turned off), so attempts do not multiply
  (``retry.py``).
* **Reads into a caller's buffer.** Large payloads stream into preallocated memory (local files and S3),
  so a reducer holds one copy of each shard, not the two or three ``cat_file`` makes.
* **Parallel transfers.** ``map`` moves several objects at once, and on S3 large objects go in parallel
  parts (multipart uploads, ranged GETs), never more than ``Transfers.concurrency`` requests in flight per
  process (``transfers.py``).

Keys are relative, ``/``-separated and validated, so nothing read from a config or a peer can escape the
run's prefix.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import errno
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from composer_serverless.rendezvous.retry import RetryPolicy, is_transient, is_unwritable
from composer_serverless.rendezvous.transfers import S3Parts, Slots, Transfers, run_all

logger = logging.getLogger(__name__)

_KEY = re.compile(r"^[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*$")
_TMP_MARK = ".tmp-"
T = TypeVar("T")
R = TypeVar("R")
# Connections an S3 client keeps open: enough for any transfer concurrency the config allows.
_S3_POOL = 64

# The memory filesystem is one dict per process that its operations read and write without a lock: its create
# is check-then-write, and a listing that copies the dict while another thread writes it can raise "dictionary
# changed size during iteration" (a CI run saw it). One lock makes each operation atomic for the threads of
# that process, which is the only place a memory:// store is visible, as every operation is on a real store.
_MEMORY_LOCK = threading.Lock()

Buffer = bytes | bytearray | memoryview
# An object's bytes, in one buffer or in several written one after another (header, then tensor memory),
# so a writer that produced them separately does not have to join them first.
Body = Buffer | list[Buffer]


# Operations that change the store: those an outage (``RetryPolicy.outage_s``) holds up rather than fails.
_WRITES = frozenset({"put", "create", "delete"})


class StoreError(RuntimeError):
    """The store cannot be reached or used as configured."""


def validate_key(key: str) -> str:
    """Reject keys that are absolute, climb out of the prefix, or carry unexpected characters."""
    if not _KEY.match(key) or any(part in (".", "..") for part in key.split("/")) or _TMP_MARK in key:
        raise ValueError(f"invalid store key {key!r}")
    return key


class ObjectStore:
    """A prefix in an object store, addressed by an fsspec URL (``s3://b/p``, ``file:///x``, ``./runs``).

    Args:
        url: where the prefix lives.
        retry: the retry policy for transient failures.
        transfers: how many requests at once, and the part size of large S3 objects.
    """

    def __init__(
        self, url: str, *, retry: RetryPolicy | None = None, transfers: Transfers | None = None
    ) -> None:
        self.url = url.rstrip("/") or url
        self.retry = retry or RetryPolicy()
        self.transfers = transfers or Transfers()
        self._slots = Slots(self.transfers.concurrency)
        options: dict[str, object] = {"use_listings_cache": False, "skip_instance_cache": True}
        if fsspec.core.split_protocol(self.url)[0] in ("s3", "s3a"):
            # This class's retry loop is the only one: botocore's and s3fs's own would multiply its attempts
            # (a dead endpoint took minutes to report) and retry without saying so. botocore's own CRC32 of
            # every body is left to operations that require one: payloads carry their checksum or MAC end to
            # end, and on a CPU shared with training the CRC was time the exchange waited for.
            options["config_kwargs"] = {
                "retries": {"mode": "standard", "total_max_attempts": 1},
                "max_pool_connections": _S3_POOL,
                "request_checksum_calculation": "when_required",
                "response_checksum_validation": "when_required",
            }
        self._fs, root = fsspec.core.url_to_fs(self.url, **options)
        self._root = root.rstrip("/")
        self.is_local = isinstance(self._fs, LocalFileSystem)
        self._is_memory = isinstance(self._fs, MemoryFileSystem)
        self._is_s3 = hasattr(self._fs, "_call_s3")
        if self._is_s3:
            self._fs.retries = 1

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def tolerate_outages(self, seconds: float) -> None:
        """Retry writes the store refuses (full, read-only, access revoked) for up to ``seconds`` before
        failing them; for this store and the children made from it afterwards."""
        self.retry = dataclasses.replace(self.retry, outage_s=seconds)

    def configure_transfers(self, transfers: Transfers) -> None:
        """Move objects ``transfers.concurrency`` requests at a time, large S3 objects in parts of
        ``transfers.part_bytes``; for this store and the children made from it afterwards."""
        self.transfers = transfers
        self._slots = Slots(transfers.concurrency)

    def map(self, fn: Callable[[T], R], items: list[T]) -> list[R]:
        """``[fn(item) for item in items]``, run ``transfers.concurrency`` at a time (threads: the store's I/O
        releases the GIL); every call finishes before this returns, and the first failure is then raised."""
        return run_all([lambda item=item: fn(item) for item in items], self.transfers.concurrency)

    def child(self, prefix: str) -> ObjectStore:
        """The store rooted at ``prefix`` below this one (a run inside the store root, say).

        The child shares this store's filesystem, retry policy and class, so a wrapper's behaviour
        (fault injection in tests) carries over.
        """
        validate_key(prefix)
        child = copy.copy(self)
        child.url = f"{self.url}/{prefix}"
        child._root = f"{self._root}/{prefix}"
        return child

    def path(self, key: str) -> str:
        """The backend path of ``key`` (a filesystem path for local stores)."""
        return f"{self._root}/{validate_key(key)}"

    def is_at(self, url: str) -> bool:
        """Whether ``url`` names this store's location, however it is spelled (a relative path, file://,
        a trailing slash); without opening it."""
        protocol, path = fsspec.core.split_protocol(url)
        if self.is_local and protocol in (None, "file", "local"):
            return os.path.realpath(LocalFileSystem._strip_protocol(url)) == os.path.realpath(self._root)
        mine = fsspec.core.split_protocol(self.url)
        return (protocol, path.rstrip("/")) == (mine[0], mine[1].rstrip("/"))

    def url_of(self, key: str) -> str:
        return f"{self.url}/{validate_key(key)}"

    # --- start-up checks ---------------------------------------------------------------------------

    def ensure_root(self) -> None:
        """Check that objects can be written under the prefix and that create-if-absent is enforced.

        A write probe catches what a listing would not (a missing bucket, a read-only mount, no
        credentials); the create probe catches servers that accept ``If-None-Match: *`` and overwrite
        anyway, on which quorums and reduced shards could be written twice.

        Raises:
            StoreError: naming the backend and what failed.
        """
        probe = f"_probe-{uuid.uuid4().hex}"
        try:
            if self.is_local:
                os.makedirs(self._root, exist_ok=True)
            first = self.create(probe, b"first")
            second = self.create(probe, b"second")
            self.delete(probe)
        except Exception as e:  # any backend error means the same thing to the user: this URL is unusable
            raise StoreError(f"cannot write to store {self.url}: {type(e).__name__}: {e}") from e
        if not first or second:
            raise StoreError(
                f"store {self.url} ({type(self._fs).__name__}) does not enforce create-if-absent: a second "
                "conditional write to one key succeeded, so conditional writes (S3 If-None-Match: *) are not "
                "honoured by this server and replicas could overwrite each other's quorum and reduced shards"
            )

    # --- writes ------------------------------------------------------------------------------------

    def put(self, key: str, data: Body) -> None:
        """Write ``key`` atomically, replacing any previous object."""
        path = self.path(key)
        if self.is_local:
            self._call("put", key, lambda: self._local_write(path, data, exclusive=False))
        elif self._is_s3:
            self._s3().put(path, key, data if isinstance(data, list) else [data], create=False)
        else:
            body = _joined(data)
            self._call("put", key, lambda: self._fs.pipe_file(path, body))

    def create(self, key: str, data: Body) -> bool:
        """Create ``key`` only if it does not exist; True if this call created it.

        When the object exists, it is read back and compared: a conditional PUT whose response was lost
        and that was retried (by us, s3fs or botocore) reports "exists" to the writer that actually won,
        and an identical object means exactly that.
        """
        path = self.path(key)
        body = data if self.is_local or self._is_s3 else _joined(data)  # joined once, not on every retry
        try:
            if self._is_s3:
                self._s3().put(path, key, body if isinstance(body, list) else [body], create=True)
            else:
                self._call("create", key, lambda: self._create_once(path, body))
        except FileExistsError:
            existing = self.get(key)
            if existing == _joined(body):
                logger.info("create-if-absent of %s reported 'exists' but the object is ours", key)
                return True
            return False
        return True

    def _create_once(self, path: str, data: Body) -> None:
        if self.is_local:
            self._local_write(path, data, exclusive=True)
        elif self._is_memory:
            self._fs.pipe_file(path, bytes(_joined(data)), mode="create")
        else:
            self._fs.pipe_file(path, _joined(data), mode="create")

    def delete(self, key: str) -> None:
        """Remove an object or a whole prefix; a missing one is not an error."""
        path = self.path(key)

        def remove() -> None:
            with contextlib.suppress(FileNotFoundError):
                self._fs.rm(path, recursive=True)

        self._call("delete", key, remove)

    # --- reads -------------------------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        """Read the whole object; FileNotFoundError if it does not exist."""
        path = self.path(key)
        if self._is_s3:
            # No HEAD first (s3fs's cat_file asks for the size to plan its ranged reads): the first GET says.
            return bytes(self._s3().read(path, key, None))
        return self._call("get", key, lambda: self._fs.cat_file(path))

    def get_into(self, key: str, out: bytearray | memoryview) -> int:
        """Read the object into ``out`` (which must be large enough) and return its size in bytes.

        Local files and S3 objects stream straight into ``out``; other backends read the object and copy it.

        Raises:
            FileNotFoundError: the object does not exist.
            ObjectTooLarge: the object is larger than ``out``.
        """
        path = self.path(key)
        view = memoryview(out).cast("B")
        if self.is_local:
            return self._call("get", key, lambda: _read_file_into(path, view))
        if self._is_s3:
            return len(self._s3().read(path, key, view))

        def copy_in() -> int:
            data = self._fs.cat_file(path)
            _check_fits(path, len(data), len(view))
            view[: len(data)] = data
            return len(data)

        return self._call("get", key, copy_in)

    def _s3(self) -> S3Parts:
        return S3Parts(self._fs, self.transfers, self._slots, self._call, _check_fits)

    def exists(self, key: str) -> bool:
        path = self.path(key)
        if self.is_local:
            return os.path.exists(path)

        def probe() -> bool:
            try:
                self._fs.info(path, refresh=True)
            except FileNotFoundError:
                return False
            return True

        return self._call("exists", key, probe)

    def list(self, prefix: str) -> list[str]:
        """Names directly under ``prefix`` (not full keys), sorted; empty if the prefix does not exist."""
        path = self.path(prefix)

        def listing() -> list[str]:
            try:
                return self._fs.ls(path, detail=False, refresh=True)
            except FileNotFoundError:
                return []

        names = (e.rstrip("/").rsplit("/", 1)[-1] for e in self._call("list", prefix, listing))
        return sorted(n for n in names if _TMP_MARK not in n)

    def list_tree(self, prefix: str = "") -> list[str]:
        """Every object key below ``prefix`` (the whole store if empty), relative to it, sorted: one listing
        request on S3."""
        path = self.path(prefix) if prefix else self._root

        def listing() -> list[str]:
            try:
                return self._fs.find(path)
            except FileNotFoundError:
                return []

        start = len(path) + 1
        keys = (p[start:] for p in self._call("list", prefix, listing) if len(p) > start)
        return sorted(k for k in keys if _TMP_MARK not in k)

    def size(self, key: str) -> int:
        path = self.path(key)
        return int(self._call("size", key, lambda: self._fs.info(path))["size"])

    def modified(self, key: str) -> float:
        """When ``key`` was last written, in seconds since the epoch by the store's own clock (S3's
        ``LastModified``, whole seconds; a file's mtime), so that processes on machines whose clocks disagree
        can still tell how long ago an object was written: against another object the store timed.
        FileNotFoundError if it does not exist."""
        path = self.path(key)
        return self._call("modified", key, lambda: self._fs.modified(path).timestamp())

    # --- directories -------------------------------------------------------------------------------

    def local_dir(self, prefix: str) -> Path | None:
        """The local directory holding ``prefix`` when the store is a local filesystem, else None."""
        return Path(self.path(prefix)) if self.is_local else None

    def upload_dir(self, local: Path, prefix: str) -> None:
        """Copy every file under ``local`` to ``prefix/`` (atomically per file)."""
        for file in sorted(p for p in local.rglob("*") if p.is_file()):
            self.put(f"{prefix}/{file.relative_to(local).as_posix()}", file.read_bytes())

    def download_dir(self, prefix: str, local: Path) -> Path:
        """Copy every object under ``prefix/`` into ``local`` and return it."""
        for rel in self.list_tree(prefix):
            target = local / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(self.get(f"{prefix}/{rel}"))
        return local

    # --- retries -----------------------------------------------------------------------------------

    def _call(self, op: str, key: str, fn: Callable[[], T]) -> T:
        """Run one backend operation, retrying transient failures per ``self.retry``; a write the store
        refuses is retried until ``self.retry.outage_s`` has passed since the first refusal."""
        if self._is_memory:
            fn = _atomic(fn)
        refused_since: float | None = None
        refusals = attempt = 0
        while True:
            try:
                return self._attempt(op, key, fn)
            except Exception as e:
                if self.retry.outage_s > 0 and op in _WRITES and is_unwritable(e):
                    now = time.monotonic()
                    refused_since = now if refused_since is None else refused_since
                    if now - refused_since >= self.retry.outage_s:
                        raise
                    if refusals % 10 == 0:
                        logger.warning(
                            "store %s %s refused (%s: %s) for %.0fs; retrying for up to %.0fs",
                            op,
                            key,
                            type(e).__name__,
                            e,
                            now - refused_since,
                            self.retry.outage_s,
                        )
                    time.sleep(self.retry.outage_delay_s(refusals))
                    refusals += 1
                    continue
                if not is_transient(e) or attempt + 1 >= self.retry.attempts:
                    raise
                delay = self.retry.delay_s(attempt)
                logger.warning(
                    "store %s %s failed (attempt %d/%d): %s: %s; retrying in %.2fs",
                    op,
                    key,
                    attempt + 1,
                    self.retry.attempts,
                    type(e).__name__,
                    e,
                    delay,
                )
                time.sleep(delay)
                attempt += 1

    def _attempt(self, op: str, key: str, fn: Callable[[], T]) -> T:
        """One try of one operation; the seam where tests inject faults below the retry loop."""
        del op, key
        return fn()

    @staticmethod
    def _local_write(path: str, data: Body, *, exclusive: bool) -> None:
        # The temporary file sits beside the target so the final link/rename never crosses filesystems.
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}{_TMP_MARK}{uuid.uuid4().hex}"
        try:  # whatever fails (a full disk mid-write), the temporary file goes
            with open(tmp, "wb") as f:
                for part in data if isinstance(data, list) else [data]:
                    f.write(part)
            if exclusive:
                os.link(tmp, path)
            else:
                os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


def _atomic(fn: Callable[[], T]) -> Callable[[], T]:
    """``fn`` run under the memory store's lock (see ``_MEMORY_LOCK``)."""

    def locked() -> T:
        with _MEMORY_LOCK:
            return fn()

    return locked


def _joined(data: Body) -> bytes | bytearray:
    """One buffer of ``data`` for backends that send a body whole (S3's PUT, the memory filesystem)."""
    if isinstance(data, list):
        return b"".join(data)
    return bytes(data) if isinstance(data, memoryview) else data


class ObjectTooLarge(ValueError):
    """An object is larger than the buffer a reader sized for what it may hold."""


def _check_fits(path: str, size: int, capacity: int) -> None:
    if size > capacity:
        raise ObjectTooLarge(
            f"{path} holds {size} bytes, more than the {capacity}-byte buffer it is read into"
        )


def _read_file_into(path: str, view: memoryview) -> int:
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        _check_fits(path, size, len(view))
        offset = 0
        while offset < size:
            n = f.readinto(view[offset:size])
            if not n:
                raise OSError(errno.EIO, f"{path}: file ended after {offset} of {size} bytes")
            offset += n
        return size
