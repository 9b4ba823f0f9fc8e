"""End to end with diloco.authenticate: a keyed run completes, its payloads and states carry MACs, and the key
appears nowhere it must not (the store, the replicas' logs and command lines, the plan, the launcher's
output); a resume finds the key where the launch left it, and without it stops with the fix."""

from __future__ import annotations

import io
import json
import stat
from pathlib import Path

import pytest
from rich.console import Console

from composer_serverless.config import ConfigError, validate_config
from composer_serverless.launch.launcher import launch, prepare, resume
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.run_keys import key_path
from composer_serverless.rendezvous.runkey import ENV, MAC_FIELD, RunKey
from composer_serverless.rendezvous.store import ObjectStore
from tests.conftest import TINY

pytestmark = pytest.mark.slow


def _config(store: Path) -> dict:
    return {
        "run_id": "keyed",
        "store": str(store),
        "model": {"tiny": TINY.model_dump()},
        "data": {"seq_len": 32, "batch_size": 4},
        # Sparse payloads: their MAC covers the indices, codes and magnitudes as it covers dense values.
        "diloco": {
            "replicas": 2,
            "sync_every": 2,
            "rounds": 2,
            "checkpoint_every": 1,
            "authenticate": True,
            "codec": "sparse",
        },
        "eval": {"sequences": 4},
        "executor": {"threads_per_replica": 1},
    }


def test_a_keyed_run_completes_and_its_key_is_nowhere_it_must_not_be(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv(ENV, raising=False)
    store = tmp_path / "store"
    config = validate_config(_config(store))
    plan = prepare(config, "keyed.toml").plan.to_json()
    output = io.StringIO()
    summary = launch(config, "keyed.toml", Console(file=output, width=120))
    assert summary["rounds_committed"] == 2 and summary["replicas_bit_identical"] is True

    run = ObjectStore(str(store)).child("keyed")
    path = key_path(run.url)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key = RunKey.from_hex(path.read_text())
    secret = key.hex()
    # Nowhere in the store (run.json, launch.json with every replica's command line, payloads, states,
    # metrics, the replicas' logs), the plan or what the launcher printed; neither as hex nor as raw bytes.
    files = [p for p in store.rglob("*") if p.is_file()]
    assert any(p.name.startswith("rank-") and p.suffix == ".log" for p in files)
    for file in files:
        data = file.read_bytes()
        assert secret.encode() not in data and key._key not in data, file
    record = json.loads(run.get(layout.LAUNCH_RECORD))
    commands = [" ".join(r["command"]) for r in record["plan"]["replicas"]]
    assert commands and all(secret not in c and "--run" in c for c in commands)
    assert secret not in plan and secret not in output.getvalue()
    # What the replicas published carries MACs under that key.
    manifest = json.loads(run.get(layout.snapshot_file(layout.global_state(2, 0), layout.SNAPSHOT_MANIFEST)))
    assert all(MAC_FIELD in entry and "sha256" not in entry for entry in manifest["files"].values())

    # A resume needs the key: without the file (and the variable), or with another key, it stops before
    # changing anything.
    run.delete(layout.SUMMARY)
    path.rename(path.with_suffix(".moved"))
    before = sorted(run.list_tree())
    with pytest.raises(ConfigError, match=f"fix: export {ENV}"):
        resume(run.url, Console(file=io.StringIO()))
    monkeypatch.setenv(ENV, RunKey.generate().hex())
    with pytest.raises(ConfigError, match="not this run's"):
        resume(run.url, Console(file=io.StringIO()))
    assert sorted(run.list_tree()) == before
