"""Loading a run's config: TOML, ``--executor``, ``--set dotted.key=value`` overrides, validation, and
error messages that name every offending key and say how to fix it."""

from __future__ import annotations

import difflib
import os
import sys
import typing
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ValidationError

from composer_serverless.config import paths
from composer_serverless.config.base import ConfigError, StrictModel
from composer_serverless.config.executors import EXECUTOR_TYPES
from composer_serverless.config.harvest import HarvestConfig
from composer_serverless.config.run import RunConfig
from composer_serverless.config.trl_names import TRL_NAMES, trl_hint

# Fields whose value an error message never repeats: a key pasted where its variable's name belongs would
# otherwise be printed (and end up in a terminal's scrollback, a CI log).
NEVER_ECHOED = ("api_key_env",)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


def load_config(
    path: str | Path, overrides: list[str] | tuple[str, ...] = (), executor_type: str | None = None
) -> RunConfig:
    """Read a TOML config, switch its executor if asked, apply ``dotted.key=value`` overrides, and validate.

    ``executor_type`` replaces the file's ``[executor]`` table when the file names another backend (its keys
    belong to that backend), and keeps it when the file already names this one; overrides come after, so
    ``--executor modal --set executor.gpu=A100-80GB`` works on any config. Relative paths in the file are
    relative to it, those in overrides to the working directory, all made absolute here (``paths.py``).

    Raises:
        ConfigError: the file is missing or not TOML, an override is malformed, a key is unknown or a value
            is invalid. The message names every offending key and how to fix it.
    """
    path = Path(os.path.abspath(path))
    raw = read_toml(path)
    paths.resolve(raw, path.parent)  # the file's paths: relative to the file
    if executor_type is not None:
        select_executor(raw, executor_type)
    for override in overrides:
        apply_override(raw, override)  # relative to the working directory
    paths.root_code(raw, path.parent)
    return validate_config(raw, source=str(path))


def load_harvest_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> HarvestConfig:
    """The ``[harvest]`` table of a TOML file (a run's config, or a file holding only that table), with
    ``--set harvest.key=value`` overrides applied; the file's other tables are not read.

    Raises:
        ConfigError: as ``load_config``, or the file has no ``[harvest]`` table.
    """
    path = Path(os.path.abspath(path))
    raw = read_toml(path)
    paths.resolve(raw, path.parent)
    for override in overrides:
        apply_override(raw, override)
    table = raw.get("harvest")
    if not isinstance(table, dict):
        close = difflib.get_close_matches("harvest", list(raw), n=1)
        hint = f"; did you mean [harvest] instead of [{close[0]}]?" if close else ""
        raise ConfigError(
            f"{path} has no [harvest] table{hint}\n  fix: add [harvest] with its [[harvest.teachers]] "
            "(docs/harvest.md)"
        )
    try:
        return _HarvestFile.model_validate({"harvest": table}).harvest
    except ValidationError as e:
        raise ConfigError(_explain(e, raw, str(path))) from None


class _HarvestFile(StrictModel):
    harvest: HarvestConfig


def read_toml(path: Path) -> dict[str, Any]:
    """The TOML file at ``path`` as a mapping (ConfigError when it is missing, unreadable or not TOML)."""
    if not path.is_file():
        raise ConfigError(
            f"config file not found: {path}\n  fix: pass the path of a TOML file, e.g. deploy/configs/local-demo.toml"
        )
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path} is not a text file (byte {e.start} is not UTF-8)\n  fix: pass the TOML config, "
            "e.g. deploy/configs/local-demo.toml"
        ) from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from e
    except OSError as e:  # unreadable: permissions, a FIFO, a file removed meanwhile
        raise ConfigError(
            f"cannot read {path}: {e.strerror or e}\n  fix: check the file's permissions"
        ) from e
    return raw


def validate_config(raw: dict[str, Any], source: str = "config") -> RunConfig:
    """Validate a raw config mapping, turning pydantic's errors into one actionable message."""
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_explain(e, raw, source)) from None


def select_executor(raw: dict[str, Any], executor_type: str) -> None:
    """Make ``raw`` use the ``executor_type`` backend, dropping a table written for another backend."""
    if executor_type not in EXECUTOR_TYPES:
        choices = ", ".join(EXECUTOR_TYPES)
        raise ConfigError(f"--executor {executor_type!r}: unknown executor; choose one of {choices}")
    table = raw.get("executor")
    if not isinstance(table, dict) or table.get("type", "local") != executor_type:
        raw["executor"] = {"type": executor_type}


def apply_override(raw: dict[str, Any], override: str) -> None:
    """Set ``dotted.key=value`` in ``raw``; the value is read as a TOML value, else taken as a string, and a
    relative path in it is relative to the working directory (``paths.py``)."""
    key, sep, text = override.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set {override!r}: expected dotted.key=value, e.g. --set diloco.replicas=2")
    try:
        value = tomllib.loads(f"v = {text.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = text.strip()
    node = raw
    *parents, leaf = key.split(".")
    for i, part in enumerate(parents):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {override!r}: {'.'.join(parents[: i + 1])} is a value, not a table")
        node = child
    node[leaf] = value
    paths.resolve(raw, Path.cwd(), under=key)


def _explain(error: ValidationError, raw: dict[str, Any], source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for item in error.errors():
        loc = [str(p) for p in item["loc"]]
        key = _display_key(loc)
        if item["type"] == "extra_forbidden":
            known = sorted(_fields_at(loc[:-1]))
            close = difflib.get_close_matches(loc[-1], known, n=1)
            parent = _display_key(loc[:-1])
            suggestion = ".".join(filter(None, [parent, *close]))
            hint = f"did you mean {suggestion}?" if close else f"known keys here: {', '.join(known)}"
            trl = trl_hint(loc[-1])
            if trl is None:
                lines.append(f"  {key}: unknown key; {hint}")
                continue
            lines.append(f"  {key}: unknown key; {trl}")
            ours = TRL_NAMES[loc[-1]].ours
            fix = f"use {ours} instead" if ours else "remove it"
            lines.append(
                f"    fix: {fix} (docs/coming-from-trl.md{f'; or did you mean {suggestion}?' if close else ''})"
            )
            continue
        if item["type"] == "union_tag_invalid":
            lines.append(
                f"  {key}.type: unknown {key} {item['ctx']['tag']!r}; choose one of {item['ctx']['expected_tags']}"
            )
            continue
        # --set cannot address an item of a list (e.g. train.channels.0.weight): point at the file only.
        settable = not any(p.isdigit() for p in loc)
        via_set = f" or pass --set {key}=<value>" if settable else ""
        if item["type"] == "missing":
            lines.append(f"  {key}: required but not set\n    fix: add it to {source}{via_set}")
            continue
        message = item["msg"].removeprefix("Value error, ")
        echo = not isinstance(item.get("input"), dict) and loc[-1] not in NEVER_ECHOED
        got = f" (got {item['input']!r})" if echo else ""
        lines.append(f"  {key}: {message}{got}")
        description = _fields_at(loc[:-1]).get(loc[-1]) if loc else None
        if description:
            lines.append(f"    {key} is the {description}")
        if isinstance(item.get("input"), dict):
            lines.append(f"    fix: edit {_table_name(loc)} in {source}")
        else:
            lines.append(f"    fix: change {key} in {source}{via_set}")
    return "\n".join(lines)


def _table_name(loc: list[str]) -> str:
    """How a TOML file names the table at ``loc``: ``[train]``, or ``the 1st [[composer.rewards]]``."""
    shown = _display_key(loc).split(".")
    if shown[-1].isdigit():
        position = int(shown[-1]) + 1
        suffix = {1: "st", 2: "nd", 3: "rd"}.get(position if position < 20 else position % 10, "th")
        return f"the {position}{suffix} [[{'.'.join(shown[:-1])}]] table"
    return f"the [{'.'.join(shown)}] table"


def _display_key(loc: list[str]) -> str:
    """The dotted key as the user writes it: without pydantic's union tags and validator names."""
    shown = [p for p in loc if not p.startswith("function-")]
    if len(shown) >= 3 and shown[0] == "executor":
        shown.pop(1)  # the discriminator tag pydantic inserts, e.g. executor.local.threads_per_replica
    return ".".join(shown) or "(top level)"


def _fields_at(loc: list[str]) -> dict[str, str | None]:
    """Field names (with descriptions) of the config table at ``loc``, following union tags."""
    candidates: list[type[BaseModel]] = [RunConfig]
    for part in loc:
        if part.startswith("function-") or part.isdigit():  # validator names, list indices
            continue
        tagged = [
            m for m in candidates if m.model_fields.get("type") and m.model_fields["type"].default == part
        ]
        if tagged:
            candidates = tagged
            continue
        field = next((m.model_fields[part] for m in candidates if part in m.model_fields), None)
        if field is None:
            return {}
        members = [_unannotated(a) for a in getattr(field.annotation, "__args__", (field.annotation,))]
        candidates = [a for a in members if isinstance(a, type) and issubclass(a, BaseModel)]
    if len(candidates) != 1:
        return {}
    return {name: f.description for name, f in candidates[0].model_fields.items()}


def _unannotated(annotation: Any) -> Any:
    """``Annotated[X, ...]`` -> ``X``: union members carry their discriminator tag this way."""
    return typing.get_args(annotation)[0] if typing.get_origin(annotation) is Annotated else annotation
