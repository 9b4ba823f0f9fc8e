"""One rule for the paths in a config: a relative path written in a config file is relative to that file's
directory, one given on the command line (``--set``) is relative to the working directory, and an unset
``store`` or ``tracking.dir`` (not in the file) is ``runs`` or ``tracking`` in the working directory (docker
compose, pyproject, torchtitan and prime-rl read their files the same way).

Paths are made absolute once, when the config is loaded, so ``run.json`` holds absolute paths (or URLs) and a
resume, a replica or a sweep never resolves them again against some other directory. The user's code (reward
files, ``[code] paths``) may live anywhere on this machine: it is named relative to ``code.root``, the
deepest directory that holds the config's own directory and every code path, so the tree shipped to cloud
replicas keeps the layout (a reward file's neighbours, its package directories) it has here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# A value that names a location through a protocol (s3://, hf://, file://), or a malformed one (s3:/bucket)
# that the store's validator explains: neither is a path on this machine.
URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:")
# Keys whose value is a path, a glob or a URL; `*` stands for every item of a list.
PATH_KEYS = (
    "store",
    "data.corpus",
    "data.heldout",
    "composer.data.prompts",
    "composer.data.heldout",
    "composer.data.pairs",
    "harvest.traces",
    "harvest.output",
    "harvest.run",
    "harvest.cache",
    "tracking.dir",
    "code.paths.*",
)
# Keys whose value is a path only when it looks like one: a Hugging Face id otherwise.
MODEL_PATH = "model.path"
# A user reward in a file: ``file.py:function``.
REWARD_FILE = re.compile(r"^(?P<file>.+\.py):(?P<function>[A-Za-z_]\w*)$")
REWARD_FN = "composer.rewards.*.fn"
NOT_PATHS = frozenset({"stdlib"})  # data.corpus = 'stdlib', the offline demo corpus


def absolute(value: str, base: Path) -> str:
    """``value`` (a path, glob or ``~/...``) as an absolute path against ``base``; a URL unchanged."""
    if URL.match(value) or value in NOT_PATHS or not value:
        return value
    return os.path.normpath(os.path.join(base, os.path.expanduser(value)))


def resolve(raw: dict[str, Any], base: Path, under: str = "") -> None:
    """Make every relative path in ``raw`` at or under the dotted key ``under`` (all of them when empty)
    absolute against ``base``, in place: data, store, code, the model directory and reward files."""
    for key in (*PATH_KEYS, MODEL_PATH, REWARD_FN):
        if not _covers(under, key):
            continue
        for parent, leaf in _slots(raw, key.split(".")):
            value = parent[leaf]
            if not isinstance(value, str):
                continue
            if key == MODEL_PATH:
                parent[leaf] = absolute(value, base) if _is_local_model(value, base) else value
            elif key == REWARD_FN:
                found = REWARD_FILE.match(value)
                if found:  # not a built-in or an import path
                    parent[leaf] = f"{absolute(found['file'], base)}:{found['function']}"
            else:
                parent[leaf] = absolute(value, base)


def root_code(raw: dict[str, Any], config_dir: Path) -> None:
    """Set ``code.root`` to the deepest directory holding ``config_dir`` and every (absolute) code path and
    reward file, and name each of them relative to it, in place: what replicas import, and the layout
    shipped to them."""
    code = raw.get("code")
    if code is None:
        code = raw["code"] = {}
    if not isinstance(code, dict):
        return  # not a table: validation says so
    paths = code.get("paths")
    paths = list(paths) if isinstance(paths, (list, tuple)) else []
    rewards = [
        (parent, leaf) for parent, leaf in _slots(raw, REWARD_FN.split(".")) if _reward_file(parent[leaf])
    ]
    entries = [p for p in paths if isinstance(p, str) and os.path.isabs(p)]
    entries += [_reward_file(parent[leaf]) for parent, leaf in rewards]
    root = os.path.commonpath([str(config_dir), *entries])
    if paths:
        code["paths"] = [os.path.relpath(p, root) if p in entries else p for p in paths]
    for parent, leaf in rewards:
        found = REWARD_FILE.match(parent[leaf])
        assert found is not None
        parent[leaf] = f"{os.path.relpath(found['file'], root)}:{found['function']}"
    code["root"] = root


def _reward_file(value: Any) -> str | None:
    """The absolute file of a reward ``file.py:function`` (after ``resolve``), else None."""
    found = REWARD_FILE.match(value) if isinstance(value, str) else None
    return found["file"] if found and os.path.isabs(found["file"]) else None


def _is_local_model(value: str, base: Path) -> bool:
    """Whether ``model.path`` names a directory rather than a Hugging Face id (``name`` or ``owner/name``):
    it starts with ``.``, ``~`` or ``/``, has more than one ``/``, or is a directory next to the config."""
    if URL.match(value):
        return False
    return value.startswith((".", "~", "/")) or value.count("/") > 1 or (base / value).is_dir()


def _covers(under: str, key: str) -> bool:
    """Whether an override of ``under`` sets ``key`` (the key itself, or a table or list holding it)."""
    if not under:
        return True
    shown = key.replace(".*", "")
    return shown == under or shown.startswith(f"{under}.") or key.startswith(f"{under}.")


def _slots(node: Any, keys: list[str]) -> Iterator[tuple[Any, Any]]:
    """Every (container, key) that ``keys`` (with ``*`` for a list's items) reaches in ``node``."""
    head, *rest = keys
    if head == "*":
        items = list(enumerate(node)) if isinstance(node, list) else []
    else:
        items = [(head, node[head])] if isinstance(node, dict) and head in node else []
    for key, child in items:
        if rest:
            yield from _slots(child, rest)
        else:
            yield node, key
