"""The user's code files (rewards, tools, environments) imported by path, one way for all of them.

Each file is imported once per process under a name derived from its absolute path (two ``rewards.py`` in two
directories never clash), with its directory first on ``sys.path`` so that it may import its neighbours, as it
would when run from its own directory. A file that fails to import leaves nothing behind in ``sys.modules``,
so the next attempt (after the user fixed it) imports it afresh.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def import_file(path: Path) -> ModuleType:
    """The module of the Python file at ``path`` (absolute), imported once; raises what its import raises."""
    path = path.resolve()
    name = f"composer_serverless_user_{path.stem}_{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
