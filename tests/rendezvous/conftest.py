from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from runs import build_tiny_model, create, digests, make_config, run_replicas

from composer_serverless.rendezvous.store import ObjectStore

# Two fragments with overlap and alpha: between rounds the local parameters differ from the global ones,
# which makes resuming (and any fault) exercise every piece of per-replica state.
REFERENCE_SETTINGS: dict[str, Any] = {
    "rounds": 5,
    "min_replicas": 2,
    "fragments": 2,
    "fragment_sync_delay": 1,
    "fragment_update_alpha": 0.5,
    "codec": "int8",
}


@dataclass(frozen=True)
class ReferenceRun:
    run: ObjectStore
    digests: dict[int, set[str]]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama with hidden 32 and its tokenizer, built once per session with save_pretrained."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> ReferenceRun:
    """One clean 2-replica run of REFERENCE_SETTINGS on file://, to compare faulty and resumed runs with."""
    root = tmp_path_factory.mktemp("reference")
    run = create(make_config(f"file://{root}/runs", "reference", tiny_model_dir, **REFERENCE_SETTINGS))
    assert run_replicas(run, root / "logs", 2) == [0, 0]
    return ReferenceRun(run, digests(run))
