"""Every image a cloud replica runs in installs the torch build the project is tested with
(``executors/runtime.py``): Modal's image as Modal's own SDK would build it, the HF Jobs command on the stock
image, and the Dockerfile for a prebuilt one; and the version is the one ``make test`` installs."""

from __future__ import annotations

import re
import shlex
from typing import Any

import tomllib
import torch

from composer_serverless.config import DEFAULT_HF_JOBS_IMAGE, validate_config
from composer_serverless.executors import runtime
from composer_serverless.executors.hf_jobs import HFJobsExecutor
from tests.executors.conftest import REPO

INSTALL_TORCH = f"python -m pip install {runtime.TORCH_REQUIREMENT} --index-url {runtime.TORCH_INDEX_URL}"


def test_the_tested_version_is_the_one_the_suite_runs_on_and_the_package_allows() -> None:
    pinned = (REPO / "Makefile").read_text().split("pip install --quiet torch==")[1].split()[0]
    assert pinned == runtime.TORCH_VERSION
    assert torch.__version__.split("+")[0] == runtime.TORCH_VERSION  # what this suite is running on
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    floor = next(r for r in project["dependencies"] if r.startswith("torch>="))
    assert floor == f"torch>={runtime.TORCH_VERSION.rsplit('.', 1)[0]}"


def _layers(image: Any) -> tuple[list[str], dict[str, str]]:
    """The Dockerfile commands Modal's image builder would be sent for ``image`` and its bases, in build
    order, and the files it mounts (remote path -> local path), read from the installed SDK's own layer
    objects (no network: nothing is built)."""
    from modal._utils.async_utils import synchronizer
    from modal.image import _Image
    from modal.mount import _Mount

    raw = image if isinstance(image, _Image) else synchronizer._translate_in(image)
    cells = dict(
        zip(
            raw._load.__code__.co_freevars,
            (c.cell_contents for c in raw._load.__closure__ or ()),
            strict=True,
        )
    )
    commands: list[str] = []
    mounts: dict[str, str] = {}
    for dep in raw._deps():
        if isinstance(dep, _Image):
            base_commands, base_mounts = _layers(dep)
            commands += base_commands
            mounts |= base_mounts
        elif isinstance(dep, _Mount):
            mounts |= {str(e.remote_path): str(e.local_file) for e in dep._entries}
    function = cells.get("dockerfile_function")
    if function is not None:
        commands += [c for c in function("2025.06").commands if not c.startswith("FROM")]
    return commands, mounts


def _dockerfile_commands(image: Any) -> list[str]:
    return _layers(image)[0]


def test_modal_image_installs_the_tested_torch_build_before_anything_else() -> None:
    from composer_serverless.executors import modal_app

    pips = [c for c in _dockerfile_commands(modal_app.image) if "pip install" in c]
    torch_installs = [c for c in pips if any(re.split("[=<>~!]", t)[0] == "torch" for t in shlex.split(c))]
    assert torch_installs == [f"RUN {INSTALL_TORCH}"], pips
    assert pips.index(torch_installs[0]) < next(i for i, c in enumerate(pips) if "transformers" in c)


def _hf_plan(**executor: Any) -> Any:
    config = validate_config(
        {
            "run_id": "img",
            "store": "s3://bucket/runs",
            "model": {"tiny": {}},
            "diloco": {"replicas": 2, "sync_every": 2, "rounds": 1},
            "executor": {
                "type": "hf_jobs",
                "package": "composer-serverless @ https://x/y.tar.gz",
                "private_store_endpoint": True,  # whatever endpoint this shell points S3 at
                **executor,
            },
        }
    )
    return HFJobsExecutor().plan(config, "s3://bucket/runs/img")


def test_hf_jobs_on_the_stock_image_install_the_tested_torch_then_the_package() -> None:
    plan = _hf_plan()
    assert plan.resources["image"] == DEFAULT_HF_JOBS_IMAGE
    assert plan.resources["torch"] == runtime.torch_build()
    shell, flag, script = plan.replicas[0].command
    assert (shell, flag) == ("bash", "-c")
    steps = script.split(" && ")
    assert steps[0] == runtime.install_torch()
    assert shlex.split(steps[0])[:6] == [
        "pip",
        "install",
        "--quiet",
        "--no-cache-dir",
        "torch==2.13.0",
        "--index-url",
    ]
    assert steps[1].startswith("pip install --quiet --no-cache-dir 'composer-serverless @")
    assert steps[2].startswith("exec python -u -m composer_serverless.replicas.worker")


def test_an_image_of_your_own_keeps_its_torch_and_the_plan_says_so() -> None:
    plan = _hf_plan(image="ghcr.io/me/cs:1", package=None)
    assert plan.replicas[0].command[:3] == ("python", "-u", "-m")
    assert plan.resources["torch"] == "as installed in ghcr.io/me/cs:1"


def test_the_dockerfile_builds_on_the_stock_image_with_the_tested_torch() -> None:
    lines = (REPO / "deploy" / "hf_jobs" / "Dockerfile").read_text().splitlines()
    assert f"FROM {DEFAULT_HF_JOBS_IMAGE}" in lines
    runs = [line for line in lines if line.startswith("RUN ")]
    assert runs[0] == f"RUN pip install {runtime.TORCH_REQUIREMENT} --index-url {runtime.TORCH_INDEX_URL}"


def test_a_modal_image_carries_the_runs_code_and_its_packages(tmp_path) -> None:
    """The image Modal would build for a run that ships code: the tested torch, the package's requirements,
    the run's requirements, then its files mounted where the replica looks for them."""
    from composer_serverless.config.code import CODE_DIR_ENV
    from composer_serverless.executors.modal import replica_module
    from composer_serverless.executors.modal_image import REMOTE_CODE

    (tmp_path / "helpers").mkdir()
    for rel in ("my_task.py", "helpers/__init__.py"):
        (tmp_path / rel).write_text("x = 1\n")
    shipped = {
        "root": str(tmp_path),
        "code": ["my_task.py", "helpers/__init__.py"],
        "requirements": ["math-verify>=0.8"],
    }
    try:
        commands, mounts = _layers(replica_module(shipped).image)
    finally:
        plain = replica_module({"code": [], "requirements": []})
    pips = [c for c in commands if "pip install" in c]
    assert pips[-1] == "RUN python -m pip install 'math-verify>=0.8'" and any(
        "torch==" in c for c in pips[:-1]
    )
    assert f"ENV {CODE_DIR_ENV}={REMOTE_CODE}" in commands
    assert mounts == {f"{REMOTE_CODE}/{rel}": str(tmp_path / rel) for rel in shipped["code"]}
    assert (
        _layers(plain.image)[1] == {} and plain.SHIPPED is None
    )  # a run shipping nothing gets the plain image
