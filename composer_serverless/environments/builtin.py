"""Which environments a run's episodes get: a built-in (``environment = "builtin:NAME"``) or the user's tools
and environment class (``tools.py``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from composer_serverless.config.composer import EpisodesConfig
from composer_serverless.environments.code import CodeEnvironments
from composer_serverless.environments.protocol import Factory
from composer_serverless.environments.tools import EnvironmentFactory

# Every name of config.composer.BUILTIN_ENVIRONMENTS, and its environments as the config sets them.
BUILTINS: dict[str, Callable[[EpisodesConfig], Factory]] = {
    "code": lambda episodes: CodeEnvironments(episodes.code_timeout_s),
}


def environment_factory(episodes: EpisodesConfig, root: Path | None) -> Factory:
    """The environments ``episodes`` names, the user's imported and checked from ``root`` (raises
    ``tools.EnvironmentConfigError`` with the fix)."""
    if episodes.builtin is not None:
        return BUILTINS[episodes.builtin](episodes)
    return EnvironmentFactory.load(episodes.tools, episodes.environment, root)
