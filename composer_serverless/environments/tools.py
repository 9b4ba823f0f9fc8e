"""TRL's conventions for tools and environments, loaded from the user's files.

- ``tools = ["my_tools.py:search", ...]``: stateless functions. Their JSON schemas come from their type hints
  and docstrings through transformers' ``get_json_schema``, as TRL builds them; a function without them is
  refused before launch.
- ``environment = "my_env.py:MyEnv"``: a class, one instance per episode, built without arguments;
  ``reset(**row)`` starts it on the dataset row and may return text appended to the prompt's last turn; its
  public methods are the tools (``reset`` and ``get_reward`` excepted); ``get_reward()``, when defined, is the
  environment's own reward for the episode (TRL's environment-owned reward); a truthy ``done`` attribute ends
  the episode.

Files are named relative to the config file (or by absolute path), imported as reward files are
(``data/code_files.py``) and shipped to every backend as reward files are.
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers.utils import get_json_schema

from composer_serverless.data.code_files import import_file
from composer_serverless.environments.protocol import ErrorMark, Step, ToolCall, unknown_tool

EXCLUDED_METHODS = ("reset", "get_reward")


class EnvironmentConfigError(ValueError):
    """A tool or environment cannot be loaded or used as configured; the message says how to fix it."""


def load(spec: str, root: Path | None) -> Any:
    """The object ``"file.py:name"`` (relative to ``root``) or ``"package.module:name"`` names."""
    target, _, name = spec.rpartition(":")
    try:
        if target.endswith(".py"):
            path = (root or Path.cwd()) / target
            if not path.is_file():
                raise EnvironmentConfigError(
                    f"{spec!r}: {path} is not there\n  fix: name the file relative to the config file, or by "
                    "absolute path"
                )
            module = import_file(path)
        else:
            module = importlib.import_module(target)
    except EnvironmentConfigError:
        raise
    except Exception as e:
        raise EnvironmentConfigError(
            f"{spec!r} does not import: {type(e).__name__}: {e}\n  fix: make the file import on its own "
            "(its packages in code.requirements, its helpers in code.paths)"
        ) from e
    if not hasattr(module, name):
        raise EnvironmentConfigError(
            f"{spec!r}: {target} defines no {name!r}\n  fix: name an object it defines"
        )
    return getattr(module, name)


def schema(fn: Callable[..., Any], spec: str) -> dict[str, Any]:
    """The tool's JSON schema as transformers builds it (type hints and a Google-style docstring)."""
    try:
        return get_json_schema(fn)
    except Exception as e:  # TypeHintParsingException, DocstringParsingException
        raise EnvironmentConfigError(
            f"tool {spec!r} has no schema: {e}\n  fix: give every argument a type hint and the function a "
            "docstring with an Args: section, as TRL's tools need"
        ) from e


def load_tools(specs: Sequence[str], root: Path | None) -> list[Callable[..., Any]]:
    """The stateless tool functions, each checked to have a schema."""
    functions = []
    for spec in specs:
        fn = load(spec, root)
        if not callable(fn) or inspect.isclass(fn):
            raise EnvironmentConfigError(f"tool {spec!r} is not a function\n  fix: name a function")
        schema(fn, spec)
        functions.append(fn)
    return functions


def load_environment_class(spec: str, root: Path | None) -> type:
    """The environment class, checked to have ``reset`` and schemas for each of its tool methods."""
    cls = load(spec, root)
    if not inspect.isclass(cls):
        raise EnvironmentConfigError(f"environment {spec!r} is not a class\n  fix: name a class")
    if not callable(getattr(cls, "reset", None)):
        raise EnvironmentConfigError(
            f"environment {spec!r} has no reset method\n  fix: define reset(self, **row), which starts an "
            "episode on a dataset row (TRL's environment_factory contract)"
        )
    for name in public_methods(cls):
        schema(getattr(cls, name), f"{spec}.{name}")
    return cls


def public_methods(cls: type) -> list[str]:
    """The methods that are tools: public functions of the class but ``reset`` and ``get_reward`` (listed on
    the class, as TRL lists them, so properties are not evaluated)."""
    return [
        name
        for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
        if not name.startswith("_") and name not in EXCLUDED_METHODS
    ]


def _answer(name: str, call: Callable[[], Any]) -> Step:
    """Run one tool call; its value, or the error it raised or returned, as the tool turn."""
    try:
        value = call()
    except Exception as e:
        text = f"{type(e).__name__}: {e}"
        return Step(json.dumps({"error": text}), error=ErrorMark("tool_raised", f"{name} raised {text}"))
    if isinstance(value, dict) and "error" in value:
        hint = str(value.get("hint") or value["error"])
        return Step(json.dumps({"error": value["error"]}), error=ErrorMark("tool_error", hint))
    return Step(value if isinstance(value, str) else json.dumps(value, default=str))


@dataclass
class ToolEnvironment:
    """The episode's tools: the stateless functions, and the methods of an environment instance if any."""

    functions: list[Callable[..., Any]]
    instance: Any = None

    def __post_init__(self) -> None:
        methods = (
            []
            if self.instance is None
            else [getattr(self.instance, n) for n in public_methods(type(self.instance))]
        )
        self._by_name = {fn.__name__: fn for fn in [*self.functions, *methods]}
        self.tools = [get_json_schema(fn) for fn in self._by_name.values()]

    def reset(self, row: dict[str, Any]) -> str | None:
        if self.instance is None:
            return None
        observation = self.instance.reset(**row)
        return None if observation is None else str(observation)

    def step(self, call: ToolCall) -> Step:
        fn = self._by_name.get(call.name)
        if fn is None:
            return unknown_tool(call.name, self._by_name)
        step = _answer(call.name, lambda: fn(**call.arguments))
        done = bool(getattr(self.instance, "done", False))
        return Step(step.observation, done, step.error)

    def state(self) -> dict[str, Any]:
        if self.instance is None:
            return {}
        return {k: v for k, v in vars(self.instance).items() if not k.startswith("_")}

    def reward(self) -> float | None:
        get_reward = getattr(self.instance, "get_reward", None)
        return None if get_reward is None else float(get_reward())

    def close(self) -> None:
        close = getattr(self.instance, "close", None)
        if callable(close):
            close()


@dataclass(frozen=True)
class EnvironmentFactory:
    """Builds one environment per episode from the configured tools and environment class."""

    functions: tuple[Callable[..., Any], ...]
    cls: type | None

    @classmethod
    def load(cls, tools: Sequence[str], environment: str | None, root: Path | None) -> EnvironmentFactory:
        """Everything imported and checked (raises ``EnvironmentConfigError`` with the fix)."""
        functions = tuple(load_tools(tools, root))
        env_cls = None if environment is None else load_environment_class(environment, root)
        return cls(functions, env_cls)

    @property
    def owns_reward(self) -> bool:
        return self.cls is not None and callable(getattr(self.cls, "get_reward", None))

    @property
    def reward_name(self) -> str:
        return "" if self.cls is None else self.cls.__name__

    def __call__(self) -> ToolEnvironment:
        return ToolEnvironment(list(self.functions), None if self.cls is None else self.cls())
