"""The user's code shipped through the run's store prefix (``code/``), for replicas that fetch it (HF Jobs):
its manifest's format, and fetching it with every file checked; and the digests of the code a run ships on
every backend (``code.json``), which a resume compares with the code as it is now.

The manifest names each file (relative to code.root) with its sha256, written after the files;
with a run key it carries a MAC over its files and digests, so a replica of an authenticated run runs no code
that someone with the bucket but not the key put there. Without a key, the checksums catch corruption only.

Local replicas import the code in place and Modal builds it into the image when the replicas start, so a
reward edited after a failure would reach a resumed run silently there, and not on HF Jobs (whose replicas
fetch what was uploaded): the launcher records the digests for every backend, and a resume refuses code
that differs from them unless told to run it (``config/resume.py``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.runkey import RunKey
from composer_serverless.rendezvous.store import ObjectStore

logger = logging.getLogger(__name__)


class ShippedCodeError(RuntimeError):
    """The run's shipped code is damaged, or was not written by the run's launcher."""


def manifest_bytes(files: dict[str, str]) -> bytes:
    """The bytes a code manifest's MAC covers: its files and digests, canonically."""
    return json.dumps(files, sort_keys=True, separators=(",", ":")).encode()


def manifest(files: dict[str, str], key: RunKey | None) -> bytes:
    """The manifest of ``files`` (relative path -> sha256), with its MAC when there is a ``key``."""
    mac = None if key is None else key.mac([manifest_bytes(files)])
    return json.dumps({"files": files, "mac": mac}, indent=1).encode()


def fetch(store: ObjectStore, into: Path, key: RunKey | None) -> Path | None:
    """The run's shipped code, written under ``into``; None when the run ships none through the store.

    Raises:
        ShippedCodeError: the manifest is malformed or (with ``key``) its MAC is wrong, a file's path leaves
            the code directory, or a file does not match its sha256.
    """
    try:
        raw = json.loads(store.get(layout.CODE_MANIFEST))
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise ShippedCodeError(f"{store.url_of(layout.CODE_MANIFEST)} is not JSON: {e}") from None
    files = raw.get("files") if isinstance(raw, dict) else None
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise ShippedCodeError(f"{store.url_of(layout.CODE_MANIFEST)} names no files")
    if key is not None and not key.verify(raw.get("mac"), [manifest_bytes(files)]):
        raise ShippedCodeError(
            "the shipped code's manifest has no valid MAC for this run's key: it was not written by this run's "
            "launcher, and none of its code will run"
        )
    for rel, digest in files.items():
        parts = PurePosixPath(rel).parts
        if not rel or PurePosixPath(rel).is_absolute() or ".." in parts:
            raise ShippedCodeError(f"shipped code path {rel!r} leaves the code directory")
        data = store.get(f"{layout.CODE}/{rel}")
        if hashlib.sha256(data).hexdigest() != digest:
            raise ShippedCodeError(f"shipped code file {rel} does not match the sha256 the launcher recorded")
        target = into / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return into


def digests(root: Path, files: Iterable[str]) -> dict[str, str]:
    """Each of ``files`` (relative to ``root``) by the sha256 of its bytes now."""
    return {rel: hashlib.sha256((root / rel).read_bytes()).hexdigest() for rel in files}


def record(store: ObjectStore, files: dict[str, str]) -> None:
    """Record ``files`` (relative path -> sha256) as the code the run ships (``layout.CODE_DIGESTS``)."""
    store.put(layout.CODE_DIGESTS, json.dumps({"files": files}, indent=1, sort_keys=True).encode())


def recorded(store: ObjectStore) -> dict[str, str] | None:
    """The code the run shipped, as ``record`` wrote it; None for a run that recorded none (created before
    runs recorded it) or whose record is unreadable (said in the log)."""
    try:
        raw = store.get(layout.CODE_DIGESTS)
    except FileNotFoundError:
        return None
    try:
        files = json.loads(raw)["files"]
        if isinstance(files, dict) and all(isinstance(v, str) for v in files.values()):
            return files
    except (ValueError, KeyError, TypeError):
        pass
    logger.warning("%s is not a record of code digests (%r)", store.url_of(layout.CODE_DIGESTS), raw[:80])
    return None


def compare(before: dict[str, str], now: dict[str, str]) -> dict[str, tuple[str | None, str | None]]:
    """Each file whose digest differs between ``before`` and ``now``, as (before, now); None where the file
    is absent (added since, or gone)."""
    return {
        rel: (before.get(rel), now.get(rel))
        for rel in sorted(before.keys() | now.keys())
        if before.get(rel) != now.get(rel)
    }
