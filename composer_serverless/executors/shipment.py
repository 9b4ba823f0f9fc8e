"""What a run ships to its replicas besides the package: the user's code (reward files, the files and package
directories ``[code] paths`` lists), the pip packages it needs, and, for cloud replicas, data named by a path
on this machine.

How each backend gets it (the plan says which, and ``--dry-run`` lists what):

* local replicas import the code in place, wherever it is on this machine (no PYTHONPATH), and run in this
  environment, so the requirements must be installed here;
* Modal adds the files to the replica image and installs the requirements in it (``modal_app.py``);
* HF Jobs replicas fetch the files from the run's store prefix (``code/``, each checked against the sha256 the
  launcher recorded) and install the requirements before the worker starts.

Cloud replicas cannot read this machine's disk, so data files named by a local path are uploaded to the run's
store prefix (``inputs/``) and the run reads them there; a local Hugging Face dataset directory is refused with
the fix (push it to the Hub). A model directory on this machine (``model.path``) is uploaded to the run's
``model/``, where the launcher also puts the tiny model, and each replica downloads it from there and loads it
with ``from_pretrained`` as it would any directory (safetensors only: no pickle is shipped); up to
``MAX_MODEL_BYTES``, since every replica start downloads it again, and the Hub (which caches and serves it near
the GPUs) carries larger ones better.
"""

from __future__ import annotations

import glob
import hashlib
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from composer_serverless.config import ConfigError, RunConfig, validate_config
from composer_serverless.config.composer import FILE_PATH
from composer_serverless.rendezvous import shipped
from composer_serverless.rendezvous.layout import CODE, CODE_MANIFEST, INPUTS, MODEL
from composer_serverless.rendezvous.runkey import RunKey

# How a backend's replicas get the code (a plan's ``shipped.how``).
IN_PLACE = "imported in place (from root); requirements must be installed here"
IMAGE = "added to the replica image, with the requirements"
STORE = "fetched by each replica from the run's store prefix code/ (sha256-checked); requirements installed before it starts"
# Config keys that name data, and the slot each is uploaded to under inputs/.
DATA_KEYS = {
    ("composer", "data", "prompts"): "prompts",
    ("composer", "data", "heldout"): "heldout",
    ("composer", "data", "pairs"): "pairs",
    ("data", "corpus"): "corpus",
    ("data", "heldout"): "corpus-heldout",
}
_SKIPPED = ("__pycache__", ".git")
# The largest model directory a launch uploads for cloud replicas: a 7-8B model in bf16 (about 16 GB) fits.
# Each replica start downloads all of it from the store, so past this the Hub is the better carrier.
MAX_MODEL_BYTES = 20 * 10**9
# Files a model directory may hold in pickle format (PyTorch weights, a Trainer's training_args.bin and
# optimizer state): never shipped, since replicas would unpickle what they read from the store.
PICKLED = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


@dataclass(frozen=True)
class Shipment:
    """The code, packages and local data of one run.

    Attributes:
        root: the directory code paths are relative to (``code.root``: holds the config and all its code).
        code: every file shipped, relative to ``root``.
        requirements: pip requirements.
        data: (config key, local files) for each data setting that names files on this machine.
        model: the model directory on this machine that cloud replicas load (uploaded to the run's model/).
    """

    root: Path | None
    code: tuple[str, ...]
    requirements: tuple[str, ...]
    data: tuple[tuple[str, tuple[str, ...]], ...]
    model: str | None = None

    def describe(self, how: str) -> dict[str, Any]:
        """What a plan shows: the files, packages and data, and how the backend gets them."""
        return {
            "how": how,
            "root": None if self.root is None else str(self.root),
            "code": list(self.code),
            "requirements": list(self.requirements),
            "data": {key: list(files) for key, files in self.data},
            "model": self.model,
        }


def plan(config: RunConfig, cloud: bool) -> Shipment:
    """The run's shipment. With ``cloud``, data named by local paths is part of it.

    Raises:
        ConfigError: a code path or reward file is not there, or a local dataset directory for the cloud.
    """
    root = None if config.code.root is None else Path(config.code.root)
    names = list(config.code.paths)
    if config.composer is not None:
        names += [r.fn.rpartition(":")[0] for r in config.composer.rewards if FILE_PATH.match(r.fn)]
        if config.composer.episodes is not None:  # tool and environment files, as reward files
            names += config.composer.episodes.files
    files: list[str] = []
    for name in dict.fromkeys(names):
        if root is None or not (root / name).exists():
            raise ConfigError(
                f"code path {name if root is None else root / name} does not exist\n  fix: name reward files and "
                "[code] paths relative to the config file (or by absolute path)"
            )
        files += _files(root, name)
    return Shipment(
        root,
        tuple(dict.fromkeys(files)),
        config.code.requirements,
        _local_data(config) if cloud else (),
        _local_model(config) if cloud else None,
    )


def from_plan(described: dict[str, Any]) -> Shipment:
    """The shipment a plan describes (``Shipment.describe``): what the executor planned, not planned again."""
    root = described["root"]
    return Shipment(
        None if root is None else Path(root),
        tuple(described["code"]),
        tuple(described["requirements"]),
        tuple((key, tuple(files)) for key, files in described["data"].items()),
        described.get("model"),
    )


def _files(root: Path, name: str) -> list[str]:
    path = root / name
    if path.is_file():
        return [name]
    return sorted(
        str(p.relative_to(root))
        for p in path.rglob("*")
        if p.is_file() and not any(part in _SKIPPED or part.endswith(".pyc") for part in p.parts)
    )


def _local_model(config: RunConfig) -> str | None:
    """``model.path`` when it is a directory on this machine (``from_pretrained`` too prefers a directory to
    a Hub id of the same name) with safetensors weights, within ``MAX_MODEL_BYTES``.

    Raises:
        ConfigError: the weights are pickles only, or the directory is too large; each with the fix.
    """
    path = config.model.path
    if path is None or not Path(path).expanduser().is_dir():
        return None
    files = model_files(Path(path).expanduser())
    if not any(p.suffix == ".safetensors" for p in files):
        raise ConfigError(
            f"model.path {Path(path).expanduser().absolute()} has no safetensors weights, and cloud replicas "
            "load nothing in pickle format from the store\n  fix: save it with save_pretrained (safetensors by "
            "default), or push it to the Hugging Face Hub and set model.path to its repo id"
        )
    size = sum(p.stat().st_size for p in files)
    if size > MAX_MODEL_BYTES:
        raise ConfigError(
            f"model.path {Path(path).expanduser().absolute()} holds {size / 1e9:.1f} GB, more than the "
            f"{MAX_MODEL_BYTES / 1e9:.0f} GB a launch uploads for cloud replicas (each replica start downloads "
            "it again)\n  fix: push it to the Hugging Face Hub (hf upload OWNER/NAME DIRECTORY) and set "
            "model.path to OWNER/NAME"
        )
    return path


def model_files(directory: Path) -> list[Path]:
    """The files of a model directory that replicas load: not hidden ones (``.git`` holds a second copy of
    every weight file of a cloned repository, ``.cache`` the Hub client's bookkeeping), not pickles."""
    return sorted(
        p
        for p in directory.rglob("*")
        if p.is_file()
        and not p.name.endswith(PICKLED)
        and not any(part.startswith(".") for part in p.relative_to(directory).parts)
    )


def _local_data(config: RunConfig) -> tuple[tuple[str, tuple[str, ...]], ...]:
    raw = config.model_dump()
    found = []
    for keys in DATA_KEYS:
        value = _get(raw, keys)
        if not isinstance(value, str) or "://" in value or value == "stdlib":
            continue
        path = Path(value).expanduser()
        if path.is_dir():
            raise ConfigError(
                f"{'.'.join(keys)} = {value!r} is a dataset directory on this machine, which cloud replicas "
                "cannot read\n  fix: push it to the Hub (dataset.push_to_hub) and name hf://datasets/OWNER/NAME, "
                "or save it as JSONL or Parquet files"
            )
        matches = sorted(glob.glob(str(path)))
        names = [Path(m).name for m in matches]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:  # one upload directory a setting: the second file of a name would replace the first
            raise ConfigError(
                f"{'.'.join(keys)} = {value!r} matches files of the same name in different directories "
                f"({', '.join(twice)}), which cloud replicas read from one directory of the run's store\n"
                "  fix: give the files distinct names, or put them in one directory"
            )
        if matches:
            found.append((".".join(keys), tuple(matches)))
    return tuple(found)


def _get(raw: dict[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        if not isinstance(raw, dict):
            return None
        raw = raw.get(key)  # type: ignore[assignment]
    return raw


def with_uploaded_data(config: RunConfig, run_url: str, shipment: Shipment) -> RunConfig:
    """``config`` reading each shipped data setting and a shipped model from the run's store prefix (where
    ``upload`` puts them)."""
    if not shipment.data and shipment.model is None:
        return config
    raw = config.model_dump()
    if shipment.model is not None:
        raw["model"]["path"] = f"{run_url}/{MODEL}"
    for dotted, files in shipment.data:
        keys = tuple(dotted.split("."))
        slot = DATA_KEYS[keys]
        target = raw
        for key in keys[:-1]:
            target = target[key]
        name = Path(files[0]).name if len(files) == 1 else "*" + "".join(Path(files[0]).suffixes)
        target[keys[-1]] = f"{run_url}/{INPUTS}/{slot}/{name}"
    return validate_config(raw, source="the resolved config")


def with_local_model(config: RunConfig, shipment: Shipment) -> RunConfig:
    """``config`` loading a shipped model from its directory on this machine (the launcher checks it there,
    before it is uploaded)."""
    if shipment.model is None:
        return config
    raw = config.model_dump()
    raw["model"]["path"] = shipment.model
    return validate_config(raw, source="the resolved config")


def upload(
    run: Any,
    shipment: Shipment,
    *,
    code: bool,
    key: RunKey | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> int:
    """Put the shipment's model and data (and, with ``code``, its code and their manifest, last) under the
    run's prefix; the bytes written. With ``key`` (an authenticated run) the manifest carries its MAC: a
    replica then runs no code that someone with the bucket but not the key put there. ``progress`` is told
    (bytes sent, bytes to send) after each file of the model."""
    written = _upload_model(run, Path(shipment.model), progress) if shipment.model is not None else 0
    for dotted, files in shipment.data:
        slot = DATA_KEYS[tuple(dotted.split("."))]
        for file in files:
            data = Path(file).read_bytes()
            run.put(f"{INPUTS}/{slot}/{Path(file).name}", data)
            written += len(data)
    if code and shipment.code:
        assert shipment.root is not None
        digests = {}  # of the bytes uploaded, read once: the replicas check each file against it
        for rel in shipment.code:
            data = (shipment.root / rel).read_bytes()
            run.put(f"{CODE}/{rel}", data)
            digests[rel] = hashlib.sha256(data).hexdigest()
            written += len(data)
        run.put(CODE_MANIFEST, shipped.manifest(digests, key))
    return written


def _upload_model(run: Any, directory: Path, progress: Callable[[int, int], None] | None) -> int:
    """The model directory's files under the run's ``model/``, each mapped from disk rather than read into
    memory (a weight file can be several GB; the store sends a large one in parts)."""
    directory = directory.expanduser()
    files = model_files(directory)
    total, sent = sum(p.stat().st_size for p in files), 0
    for file in files:
        with open(file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            key = f"{MODEL}/{file.relative_to(directory).as_posix()}"
            if size == 0:  # an empty file cannot be mapped
                run.put(key, b"")
            else:
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                    run.put(key, mapped)
        sent += size
        if progress is not None:
            progress(sent, total)
    return sent


def missing_requirements(requirements: tuple[str, ...]) -> list[str]:
    """The requirements this environment does not satisfy (local replicas run in it)."""
    from packaging.requirements import InvalidRequirement, Requirement

    missing = []
    for text in requirements:
        try:
            requirement = Requirement(text)
            installed = metadata.version(requirement.name)
        except (InvalidRequirement, metadata.PackageNotFoundError):
            missing.append(text)
            continue
        if requirement.specifier and not requirement.specifier.contains(installed, prereleases=True):
            missing.append(text)
    return missing
