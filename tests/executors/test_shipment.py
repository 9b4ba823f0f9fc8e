"""A run's shipment: which files and packages, data uploaded for cloud replicas, and the code a replica fetches
from the store, checked file by file (and MACed with a run key)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from composer_serverless.config import ConfigError, validate_config
from composer_serverless.executors import shipment
from composer_serverless.rendezvous import layout, shipped
from composer_serverless.rendezvous.runkey import RunKey
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import read_heartbeats
from composer_serverless.replicas.worker import run_worker


def _config(root: Path, **code: object) -> object:
    (root / "train.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    return validate_config(
        {
            "model": {"tiny": {}},
            "train": {"objective": "composer"},
            "diloco": {"replicas": 1, "sync_every": 1, "rounds": 1},
            "composer": {
                "data": {"prompts": str(root / "train.jsonl"), "heldout": str(root / "train.jsonl")},
                "rewards": [{"fn": "my_task.py:accuracy"}],
            },
            "code": {"root": str(root), **code},
        }
    )


def test_the_shipment_is_the_reward_files_and_the_listed_paths(tmp_path: Path) -> None:
    (tmp_path / "my_task.py").write_text("")
    (tmp_path / "helpers" / "__pycache__").mkdir(parents=True)
    for rel in ("helpers/__init__.py", "helpers/data.json", "helpers/__pycache__/x.pyc"):
        (tmp_path / rel).write_text("")
    ship = shipment.plan(_config(tmp_path, paths=["helpers"], requirements=["numpy"]), cloud=True)
    assert ship.code == ("helpers/__init__.py", "helpers/data.json", "my_task.py")
    assert ship.requirements == ("numpy",)
    assert ship.data == (
        ("composer.data.prompts", (str(tmp_path / "train.jsonl"),)),
        ("composer.data.heldout", (str(tmp_path / "train.jsonl"),)),
    )
    assert shipment.plan(_config(tmp_path), cloud=False).data == ()  # local replicas read it in place
    moved = shipment.with_uploaded_data(_config(tmp_path), "s3://b/runs/r", ship)
    assert moved.composer.data.prompts == "s3://b/runs/r/inputs/prompts/train.jsonl"


def test_a_reward_file_that_is_not_there_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as refused:
        shipment.plan(_config(tmp_path), cloud=False)
    assert str(refused.value) == (
        f"code path {tmp_path / 'my_task.py'} does not exist\n  fix: name reward files and [code] paths "
        "relative to the config file (or by absolute path)"
    )


def test_a_local_dataset_directory_is_refused_for_the_cloud_with_the_fix(tmp_path: Path) -> None:
    (tmp_path / "my_task.py").write_text("")
    config = _config(tmp_path)
    (tmp_path / "dataset").mkdir()
    raw = config.model_dump()
    raw["composer"]["data"]["prompts"] = str(tmp_path / "dataset")
    with pytest.raises(ConfigError, match=r"(?s)is a dataset directory on this machine.*push_to_hub"):
        shipment.plan(validate_config(raw), cloud=True)


def test_local_files_of_one_name_in_two_directories_are_refused_for_the_cloud(tmp_path: Path) -> None:
    """Uploaded side by side under inputs/, the second would replace the first: half the data, silently."""
    (tmp_path / "my_task.py").write_text("")
    for part in ("a", "b"):
        (tmp_path / part).mkdir()
        (tmp_path / part / "train.jsonl").write_text(json.dumps({"prompt": part, "answer": "1"}) + "\n")
    raw = _config(tmp_path).model_dump()
    raw["composer"]["data"]["prompts"] = str(tmp_path / "*" / "train.jsonl")
    with pytest.raises(
        ConfigError, match=r"(?s)files of the same name in different directories \(train.jsonl\)"
    ):
        shipment.plan(validate_config(raw), cloud=True)
    assert shipment.plan(validate_config(raw), cloud=False).data == ()  # local replicas read them in place


def test_requirements_this_environment_lacks_are_named() -> None:
    assert shipment.missing_requirements(("pytest", "pytest>=1", "pytest<1", "no-such-package-here")) == [
        "pytest<1",
        "no-such-package-here",
    ]


def _store_with_code(tmp_path: Path, files: dict[str, bytes], key: RunKey | None) -> ObjectStore:
    (tmp_path / "src").mkdir(exist_ok=True)
    for rel, data in files.items():
        (tmp_path / "src" / rel).write_bytes(data)
    ship = shipment.Shipment(tmp_path / "src", tuple(files), (), ())
    store = ObjectStore(str(tmp_path / "run"))
    shipment.upload(store, ship, code=True, key=key)
    return store


def test_a_replica_fetches_the_code_a_launcher_shipped_and_refuses_it_tampered(tmp_path: Path) -> None:
    store = _store_with_code(tmp_path, {"my_task.py": b"x = 1\n"}, None)
    assert (shipped.fetch(store, tmp_path / "a", None) / "my_task.py").read_bytes() == b"x = 1\n"
    assert (
        shipped.fetch(ObjectStore(str(tmp_path / "empty")), tmp_path / "b", None) is None
    )  # nothing shipped
    store.put(f"{layout.CODE}/my_task.py", b"import os; os.system('evil')\n")
    with pytest.raises(shipped.ShippedCodeError, match="does not match the sha256"):
        shipped.fetch(store, tmp_path / "c", None)


def test_a_replica_that_refuses_tampered_code_says_so_and_leaves_no_files(
    tmp_path: Path, monkeypatch
) -> None:
    """Through the replica's entry point: the failure is on its heartbeat, its scratch directory is gone."""
    root = tmp_path / "src"
    root.mkdir()
    store = _store_with_code(tmp_path, {"my_task.py": b"x = 1\n"}, None)
    store.put(layout.RUN_CONFIG, _config(root).model_dump_json().encode())
    store.put(f"{layout.CODE}/my_task.py", b"evil = 1\n")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    with pytest.raises(shipped.ShippedCodeError, match="does not match the sha256"):
        run_worker(store.url, 0, ObjectStore)
    assert read_heartbeats(store)[0]["state"] == "failed"
    assert not list(scratch.iterdir())


def test_with_a_run_key_only_the_launchers_manifest_is_trusted(tmp_path: Path) -> None:
    key = RunKey.generate()
    store = _store_with_code(tmp_path, {"my_task.py": b"x = 1\n"}, key)
    assert shipped.fetch(store, tmp_path / "a", key) is not None
    forged = {"my_task.py": "0" * 64}
    store.put(f"{layout.CODE}/my_task.py", b"evil = 1\n")
    store.put(layout.CODE_MANIFEST, shipped.manifest(forged, None))  # someone with the bucket, not the key
    with pytest.raises(shipped.ShippedCodeError, match="no valid MAC"):
        shipped.fetch(store, tmp_path / "b", key)
    store.put(layout.CODE_MANIFEST, shipped.manifest({"../escape.py": "0" * 64}, None))
    with pytest.raises(shipped.ShippedCodeError, match="leaves the code directory"):
        shipped.fetch(store, tmp_path / "c", None)


def _model_config(model: Path) -> object:
    return validate_config(
        {"model": {"path": str(model)}, "diloco": {"replicas": 1, "sync_every": 1, "rounds": 1}}
    )


def _model_dir(tmp_path: Path, tiny_model_dir: Path) -> Path:
    """The tiny model as a clone of its Hub repository or a Trainer leaves it: with a .git holding a second
    copy of the weights, the Hub client's .cache, and pickles (a Trainer's training_args.bin)."""
    import shutil

    model = tmp_path / "my-model"
    shutil.copytree(tiny_model_dir, model)
    (model / ".git" / "lfs").mkdir(parents=True)
    (model / ".git" / "lfs" / "weights").write_bytes(b"\0" * 1000)
    (model / ".cache").mkdir()
    (model / ".cache" / "download.lock").write_text("")
    (model / "training_args.bin").write_bytes(b"\x80\x04pickle")
    return model


def test_a_model_directory_is_shipped_to_cloud_replicas_through_the_runs_model_prefix(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    model = _model_dir(tmp_path, tiny_model_dir)
    config = _model_config(model)
    assert shipment.plan(config, cloud=False).model is None  # local replicas load it in place
    ship = shipment.plan(config, cloud=True)
    assert ship.model == str(model) and shipment.from_plan(ship.describe(shipment.STORE)) == ship
    moved = shipment.with_uploaded_data(config, "s3://b/runs/r", ship)
    assert moved.model.path == "s3://b/runs/r/model"
    assert shipment.with_local_model(moved, ship).model.path == str(model)  # checked here, before the upload
    run = ObjectStore(str(tmp_path / "store")).child("r")
    told: list[tuple[int, int]] = []
    written = shipment.upload(run, ship, code=False, progress=lambda sent, total: told.append((sent, total)))
    files = sorted(p.relative_to(tiny_model_dir).as_posix() for p in tiny_model_dir.rglob("*") if p.is_file())
    assert run.list_tree(layout.MODEL) == files  # nothing hidden (.git, .cache), no pickle
    assert all(run.get(f"{layout.MODEL}/{f}") == (tiny_model_dir / f).read_bytes() for f in files)
    total = sum((tiny_model_dir / f).stat().st_size for f in files)
    assert written == total and len(told) == len(files) and told[-1] == (total, total)
    assert [sent for sent, _ in told] == sorted(sent for sent, _ in told)


def test_a_replica_loads_a_shipped_model_from_the_store_with_from_pretrained(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """From a store it cannot read as a directory (as S3): downloaded, then loaded as any directory; the
    weights are the ones on the launcher's machine."""
    import torch

    from composer_serverless.models.loading import load_model
    from composer_serverless.replicas.weights import digest, load_run_model, model_source

    ship = shipment.plan(_model_config(tiny_model_dir), cloud=True)
    run = ObjectStore("memory://shipped-model/runs").child("r")
    shipment.upload(run, ship, code=False)
    config = shipment.with_uploaded_data(_model_config(tiny_model_dir), run.url, ship)
    assert model_source(run, config, tmp_path / "cache") == tmp_path / "cache"
    shipped_weights = dict(load_run_model(run, config, tmp_path).model.named_parameters())
    here = dict(load_model(config.model, tiny_model_dir).model.named_parameters())
    assert digest(shipped_weights) == digest(here) and len(here) > 0
    assert all(torch.equal(shipped_weights[n], here[n]) for n in here)
    assert model_source(run, _model_config(tiny_model_dir), tmp_path) == str(tiny_model_dir)  # not shipped


def test_a_model_directory_with_pickled_weights_only_is_refused_for_the_cloud(tmp_path: Path) -> None:
    """Replicas would unpickle what they read from the store: safetensors, or the Hub."""
    model = tmp_path / "old-model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(ConfigError) as refused:
        shipment.plan(_model_config(model), cloud=True)
    assert str(refused.value) == (
        f"model.path {model} has no safetensors weights, and cloud replicas load nothing in pickle format from "
        "the store\n  fix: save it with save_pretrained (safetensors by default), or push it to the Hugging "
        "Face Hub and set model.path to its repo id"
    )


def test_a_model_directory_past_the_size_guard_is_refused_with_the_hub_as_the_fix(tmp_path: Path) -> None:
    model = tmp_path / "big-model"
    model.mkdir()
    with open(model / "model.safetensors", "wb") as f:
        f.truncate(21 * 10**9)  # sparse: 21 GB on paper, nothing on disk
    with pytest.raises(ConfigError) as refused:
        shipment.plan(_model_config(model), cloud=True)
    assert str(refused.value) == (
        f"model.path {model} holds 21.0 GB, more than the 20 GB a launch uploads for cloud replicas (each "
        "replica start downloads it again)\n  fix: push it to the Hugging Face Hub (hf upload OWNER/NAME "
        "DIRECTORY) and set model.path to OWNER/NAME"
    )
    assert shipment.plan(_model_config(model), cloud=False).model is None  # a local run reads it in place
