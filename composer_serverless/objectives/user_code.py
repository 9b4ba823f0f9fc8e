"""Where in the user's own code (reward files, ``[code] paths``) a replica's failure happened.

A failure there is the user's to fix: a reward that raises on some completion raises again when the replica
is started again or the run resumed with the same code. The replica names the place in its final heartbeat
(``user_code``: a path relative to the code's directory, and a line), so the launcher can say to fix that
line first instead of offering a resume that repeats the failure.
"""

from __future__ import annotations

import traceback
from pathlib import Path, PurePosixPath

from composer_serverless.config import RunConfig
from composer_serverless.config.composer import FILE_PATH
from composer_serverless.objectives.rewards import code_root


def failed_at(error: BaseException, config: RunConfig) -> str | None:
    """``file:line`` of the innermost frame of ``error``'s traceback that runs the user's code, looking
    through what it was raised from; None when none does (the failure is elsewhere).

    The user's code is what the run ships: each reward file and each of ``[code] paths`` (a file, or every
    file in a directory), under the directory this process finds them in (``rewards.code_root``); not
    everything under that directory, which may hold a checkout of this package.
    """
    root = code_root(config)
    if root is None:
        return None
    base = root.resolve()
    names = [PurePosixPath(name) for name in _shipped_names(config)]
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for frame in reversed(traceback.extract_tb(current.__traceback__)):
            path = Path(frame.filename)
            if not path.is_absolute() or not path.resolve().is_relative_to(base):
                continue
            relative = PurePosixPath(path.resolve().relative_to(base).as_posix())
            if any(relative == name or relative.is_relative_to(name) for name in names):
                return f"{relative}:{frame.lineno}"
        current = current.__cause__ or current.__context__
    return None


def _shipped_names(config: RunConfig) -> list[str]:
    """The run's code as ``[code] paths`` and reward files name it, relative to its directory."""
    rewards = [] if config.composer is None else config.composer.rewards
    return [*config.code.paths, *(r.fn.rpartition(":")[0] for r in rewards if FILE_PATH.match(r.fn))]
