"""Where the launcher keeps a run's key (``diloco.authenticate``) between ``launch`` and ``launch --resume``.

The key must never reach the store, ``run.json``, ``launch.json``, a plan or a log, yet a resume (or a
relaunch from another shell) needs the same key, or the replicas would reject every state the run wrote.
So it stays with the user:

* If ``COMPOSER_SERVERLESS_RUN_KEY`` is set when the run is launched, that key is the run's, and the user
  keeps it (a secrets manager, say); nothing is written. ``--resume`` then needs it set again.
* Otherwise the launcher makes a random key and writes it to
  ``$XDG_CONFIG_HOME/composer-serverless/keys/<sha256 of the run URL>.key`` (``~/.config`` by default),
  readable by the user alone (0600, in a 0700 directory), before anything of the run is written.
  ``--resume`` reads it back from there (the environment variable, if set, wins). A key file is never
  overwritten: a launch that finds one for its URL (an earlier launch that failed before creating the run,
  or a second launcher racing for the same run id) uses the key in it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

import fsspec

from composer_serverless.config import ConfigError
from composer_serverless.rendezvous import runkey
from composer_serverless.rendezvous.runkey import RunKey, RunKeyError
from composer_serverless.rendezvous.store import ObjectStore


def key_dir(environ: Mapping[str, str] = os.environ) -> Path:
    base = environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "composer-serverless" / "keys"


def key_path(run_url: str, environ: Mapping[str, str] = os.environ) -> Path:
    """The key file of the run at ``run_url``: named by a hash of the URL (which itself says nothing secret),
    a local run's by its real path, however it is spelled (``./runs/x``, ``file:///abs/runs/x``)."""
    protocol, path = fsspec.core.split_protocol(run_url)
    if protocol in (None, "file", "local"):
        run_url = "file://" + os.path.realpath(path)
    return key_dir(environ) / f"{hashlib.sha256(run_url.rstrip('/').encode()).hexdigest()[:32]}.key"


def _from_env(environ: Mapping[str, str]) -> RunKey | None:
    try:
        return runkey.from_env(environ)
    except RunKeyError as e:
        raise ConfigError(f"{e}\n  fix: unset {runkey.ENV}, or set it to the run's key") from None


def new_run_key(run_url: str, environ: Mapping[str, str] = os.environ) -> RunKey:
    """The key of a run being launched: the user's (``runkey.ENV``), or a new one saved for ``--resume``.

    Raises:
        ConfigError: the environment holds a malformed key, or the key file cannot be written.
    """
    key = _from_env(environ)
    if key is not None:
        return key
    key = RunKey.generate()
    path = key_path(run_url, environ)
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key.hex() + "\n")
    except FileExistsError:
        return saved_run_key(run_url, environ)
    except OSError as e:
        raise ConfigError(
            f"cannot save the run key to {path}: {e}\n"
            f"  fix: make {path.parent} writable, or export {runkey.ENV}=<64 hex digits> to keep the key yourself"
        ) from None
    return key


def saved_run_key(
    run_url: str, environ: Mapping[str, str] = os.environ, *, then: str = "resume again"
) -> RunKey:
    """The key of an existing run, for ``--resume`` (or ``export``: ``then`` is what the fix says to do next):
    ``runkey.ENV`` if set, else the saved key file.

    Raises:
        ConfigError: neither holds a key (exit 2, with the fix).
    """
    key = _from_env(environ)
    if key is not None:
        return key
    path = key_path(run_url, environ)
    try:
        return RunKey.from_hex(path.read_text(), source=str(path))
    except FileNotFoundError:
        raise ConfigError(
            f"the run at {run_url} authenticates its payloads (diloco.authenticate) and its key is neither in "
            f"{runkey.ENV} nor in {path}: its replicas could not read any state the run wrote\n"
            f"  fix: export {runkey.ENV}=<the run's key> (or copy the key file from the machine that launched "
            f"it), then {then}"
        ) from None
    except (OSError, RunKeyError) as e:
        raise ConfigError(
            f"cannot read the run key from {path}: {e}\n  fix: export {runkey.ENV}=<the run's key>"
        ) from None


def checked_run_key(run: ObjectStore, *, then: str = "resume again") -> RunKey:
    """The saved key of the existing run at ``run`` (``saved_run_key``), held to the run's fingerprint, so a
    wrong key is told at once instead of every state it reads being rejected.

    Raises:
        ConfigError: no key, or not this run's (exit 2, with the fix).
    """
    key = saved_run_key(run.url, then=then)
    try:
        runkey.check_fingerprint(run, key)
    except runkey.WrongRunKey as e:
        raise ConfigError(
            f"{e}\n  fix: export {runkey.ENV}=<the key this run was launched with>, or unset it to use the key "
            "the launcher saved"
        ) from None
    return key
