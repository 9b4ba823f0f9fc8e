"""Train on Modal with ``modal run``: one run, or a grid of runs.

    modal run deploy/modal_app.py --config deploy/configs/modal-demo.toml --replicas 4
    modal run deploy/modal_app.py::sweep --config deploy/configs/modal-demo.toml \\
        --grid "diloco.outer_lr=0.5,0.7 diloco.sync_every=10,20"

Thin on purpose: both entrypoints run the ``composer-serverless`` CLI with the Modal executor, which spawns
the replicas (the GPU function in ``composer_serverless/executors/modal_app.py``) in a detached app of their
own, watches them through the store, and prints the report (or, for a grid, the results table). So
``modal run`` and ``composer-serverless launch --executor modal`` behave the same, Ctrl-C's choice between
cancelling and detaching included, and ``status``/``logs``/``cancel`` work on the printed run URL later.
"""

import shlex

import modal

from composer_serverless.cli import run

launcher = modal.App("composer-serverless-launch")
# `modal run FILE` runs the file's single module-level local entrypoint; a second one would make that form
# ambiguous. So the grid's entrypoint is registered on its own App bound to the name `sweep` and is not bound
# at module level itself: `modal run FILE::sweep` selects it (modal matches "sweep.<entrypoint>").
sweep = modal.App("composer-serverless-sweep")


@launcher.local_entrypoint()
def main(config: str, replicas: int = 0, set: str = "", dry_run: bool = False) -> None:
    """Train one run on Modal. --set takes space-separated key=value overrides (quote the whole list)."""
    argv = ["launch", config, "--executor", "modal", *_common(replicas, set)]
    _exit(run([*argv, "--dry-run"] if dry_run else argv))


def _grid(config: str, grid: str, replicas: int = 0, set: str = "") -> None:
    """Run each combination of --grid "key=v1,v2 key2=v1,v2" as its own run on Modal; print a table."""
    grids = [arg for item in shlex.split(grid) for arg in ("--grid", item)]
    _exit(run(["sweep", config, "--executor", "modal", *grids, *_common(replicas, set)]))


sweep.local_entrypoint(name="grid")(_grid)


def _common(replicas: int, overrides: str) -> list[str]:
    sets = [arg for item in shlex.split(overrides) for arg in ("--set", item)]
    return [*sets, *(["--replicas", str(replicas)] if replicas else [])]


def _exit(code: int) -> None:
    if code:
        raise SystemExit(code)
