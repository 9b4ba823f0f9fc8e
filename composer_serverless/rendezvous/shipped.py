"""The user's code shipped through the run's store prefix (``code/``), for replicas that fetch it (HF Jobs):
its manifest's format, and fetching it with every file checked.

The manifest names each file (relative to code.root) with its sha256, written after the files;
with a run key it carries a MAC over its files and digests, so a replica of an authenticated run runs no code
that someone with the bucket but not the key put there. Without a key, the checksums catch corruption only.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path, PurePosixPath

from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.runkey import RunKey
from composer_serverless.rendezvous.store import ObjectStore


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
