"""The object store every replica and the launcher share: one fsspec-backed implementation.

Replicas coordinate only through objects, so three properties matter more than speed:

* **Atomic writes.** A reader never sees half an object. S3-like stores give this per PUT; on a local
  filesystem we write a temporary file beside the target and ``os.replace`` it.
* **Create-if-absent.** Objects two replicas could both write (markers, quorums, reduced shards) are
  created exactly once: ``os.link`` locally, ``If-None-Match: *`` on S3 (s3fs ``mode="create"``).
* **Fresh listings.** fsspec caches directory listings by default, which makes a barrier wait forever on
  stale data; every filesystem here is built with the listing cache off and its own instance.

Keys are relative, ``/``-separated and validated, so nothing read from a config or a peer can escape the
run's prefix.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import uuid
from pathlib import Path

import fsspec
from fsspec.implementations.local import LocalFileSystem

logger = logging.getLogger(__name__)

_KEY = re.compile(r"^[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*$")
_TMP_MARK = ".tmp-"


class StoreError(RuntimeError):
    """The store cannot be reached or used as configured."""


def validate_key(key: str) -> str:
    """Reject keys that are absolute, climb out of the prefix, or carry unexpected characters."""
    if not _KEY.match(key) or any(part in (".", "..") for part in key.split("/")) or _TMP_MARK in key:
        raise ValueError(f"invalid store key {key!r}")
    return key


class ObjectStore:
    """A prefix in an object store, addressed by an fsspec URL (``s3://b/p``, ``file:///x``, ``./runs``)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/") or url
        self._fs, self._root = fsspec.core.url_to_fs(self.url, use_listings_cache=False, skip_instance_cache=True)
        self._root = self._root.rstrip("/")
        self.is_local = isinstance(self._fs, LocalFileSystem)

    def __repr__(self) -> str:
        return f"ObjectStore({self.url!r})"

    def child(self, prefix: str) -> ObjectStore:
        """The store rooted at ``prefix`` below this one (a run inside the store root, say)."""
        validate_key(prefix)
        return ObjectStore(f"{self.url}/{prefix}")

    def path(self, key: str) -> str:
        """The backend path of ``key`` (a filesystem path for local stores)."""
        return f"{self._root}/{validate_key(key)}"

    def url_of(self, key: str) -> str:
        return f"{self.url}/{validate_key(key)}"

    def ensure_root(self) -> None:
        """Check that objects can be written under the prefix; raise StoreError with the cause if not.

        A write probe catches what a listing would not: a missing bucket, a read-only mount, no credentials.
        """
        probe = f"_probe-{uuid.uuid4().hex}"
        try:
            if self.is_local:
                os.makedirs(self._root, exist_ok=True)
            self.put(probe, b"")
            self.delete(probe)
        except Exception as e:  # any backend error means the same thing to the user: this URL is unusable
            raise StoreError(f"cannot write to store {self.url}: {type(e).__name__}: {e}") from e

    def put(self, key: str, data: bytes) -> None:
        """Write ``key`` atomically, replacing any previous object."""
        path = self.path(key)
        if self.is_local:
            self._local_write(path, data, exclusive=False)
        else:
            self._fs.pipe_file(path, data)

    def create(self, key: str, data: bytes) -> bool:
        """Create ``key`` only if it does not exist; True if this call created it."""
        path = self.path(key)
        try:
            if self.is_local:
                self._local_write(path, data, exclusive=True)
            else:
                self._fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            return False
        return True

    def get(self, key: str) -> bytes:
        """Read the whole object; FileNotFoundError if it does not exist."""
        return self._fs.cat_file(self.path(key))

    def exists(self, key: str) -> bool:
        path = self.path(key)
        if self.is_local:
            return os.path.exists(path)
        try:
            self._fs.info(path, refresh=True)
        except FileNotFoundError:
            return False
        return True

    def list(self, prefix: str) -> list[str]:
        """Names directly under ``prefix`` (not full keys), sorted; empty if the prefix does not exist."""
        try:
            entries = self._fs.ls(self.path(prefix), detail=False, refresh=True)
        except FileNotFoundError:
            return []
        names = (e.rstrip("/").rsplit("/", 1)[-1] for e in entries)
        return sorted(n for n in names if _TMP_MARK not in n)

    def size(self, key: str) -> int:
        return int(self._fs.info(self.path(key))["size"])

    def delete(self, key: str) -> None:
        """Remove an object or a whole prefix; a missing one is not an error."""
        with contextlib.suppress(FileNotFoundError):
            self._fs.rm(self.path(key), recursive=True)

    def local_dir(self, prefix: str) -> Path | None:
        """The local directory holding ``prefix`` when the store is a local filesystem, else None."""
        return Path(self.path(prefix)) if self.is_local else None

    def upload_dir(self, local: Path, prefix: str) -> None:
        """Copy every file under ``local`` to ``prefix/`` (atomically per file)."""
        for file in sorted(p for p in local.rglob("*") if p.is_file()):
            self.put(f"{prefix}/{file.relative_to(local).as_posix()}", file.read_bytes())

    def download_dir(self, prefix: str, local: Path) -> Path:
        """Copy every object under ``prefix/`` into ``local`` and return it."""
        for path in self._fs.find(self.path(prefix)):
            rel = path[len(self.path(prefix)) + 1 :]
            if _TMP_MARK in rel:
                continue
            target = local / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(self._fs.cat_file(path))
        return local

    @staticmethod
    def _local_write(path: str, data: bytes, *, exclusive: bool) -> None:
        # The temporary file sits beside the target so the final link/rename never crosses filesystems.
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}{_TMP_MARK}{uuid.uuid4().hex}"
        with open(tmp, "wb") as f:
            f.write(data)
        try:
            if exclusive:
                os.link(tmp, path)
            else:
                os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
