"""The user's code and packages that every replica needs: reward files, their helpers, their pip packages."""

from __future__ import annotations

import re
from pathlib import PurePosixPath

from pydantic import Field, field_validator

from composer_serverless.config.base import StrictModel

# Where a replica finds the code shipped to it (set by the worker, or by the Modal image); code.root when
# unset, as in a local run.
CODE_DIR_ENV = "COMPOSER_SERVERLESS_CODE_DIR"
# A pip requirement: a name with extras and a version, or a URL; never a pip option.
REQUIREMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._,-]+\])?\s*(@\s*\S+|[<>=!~;].*)?$")


class CodeConfig(StrictModel):
    """Files and packages shipped to every replica on every backend: Modal adds them to its image, HF Jobs
    replicas fetch the files from the run's store prefix (checksummed) and install the packages before they
    start, local replicas import the files in place. Reward files named by ``fn = "file.py:function"``, and the
    tool and environment files of ``[composer.episodes]``, are shipped without being listed; the packages they
    import go in ``requirements``."""

    paths: tuple[str, ...] = Field(
        (),
        description="files or package directories the rewards, tools and environment import, relative to the "
        "config file (anywhere on this machine)",
    )
    requirements: tuple[str, ...] = Field(
        (),
        description="pip requirements the replicas install (the packages rewards, tools and environments "
        "import), e.g. 'math-verify>=0.8'",
    )
    root: str | None = Field(
        None,
        description="the directory paths and reward files are named relative to in run.json: set when the "
        "config is loaded, to the deepest directory holding the config file and all of its code",
    )
    accept_changes: bool = Field(
        False,
        description="launch --resume only: run the code as it is now although it changed since the run "
        "shipped it (each changed file is recorded in config-changes.json); never kept in run.json, so the "
        "next resume compares again",
    )

    @field_validator("paths")
    @classmethod
    def _inside_the_root(cls, paths: tuple[str, ...]) -> tuple[str, ...]:
        for path in paths:
            parts = PurePosixPath(path).parts
            if not path or PurePosixPath(path).is_absolute() or ".." in parts:
                raise ValueError(f"{path!r}: code paths in run.json are relative to code.root, inside it")
        return paths

    @field_validator("requirements")
    @classmethod
    def _pip_requirements(cls, requirements: tuple[str, ...]) -> tuple[str, ...]:
        bad = [r for r in requirements if not REQUIREMENT.match(r.strip())]
        if bad:
            raise ValueError(f"{bad} are not pip requirements (a name, optional extras and a version or URL)")
        return requirements
