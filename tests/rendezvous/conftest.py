from __future__ import annotations

from pathlib import Path

import pytest
from harness import REFERENCE_SETTINGS, ReferenceRun, create, digests, make_config, run_replicas


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> ReferenceRun:
    """One clean 2-replica run of REFERENCE_SETTINGS on file://, to compare faulty and resumed runs with."""
    root = tmp_path_factory.mktemp("reference")
    run = create(make_config(f"file://{root}/runs", "reference", tiny_model_dir, **REFERENCE_SETTINGS))
    assert run_replicas(run, root / "logs", 2) == [0, 0]
    return ReferenceRun(run, digests(run))
