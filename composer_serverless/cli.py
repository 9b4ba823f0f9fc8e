"""``composer-serverless``: the command line. Thin: parse, configure logging, call the launcher.

Exit status 2 means the input was wrong (config, overrides, store) and nothing was launched or written;
1 means a run failed.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from composer_serverless.config import ConfigError, load_config
from composer_serverless.rendezvous.store import StoreError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Train a Hugging Face causal LM with DiLoCo across replicas that meet only in an object store.",
)
console = Console()
err_console = Console(stderr=True)


@app.callback()
def _main(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="log at INFO level")] = False) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


@app.command()
def launch(
    config: Annotated[
        Path | None, typer.Argument(help="TOML config, e.g. deploy/configs/local-demo.toml; omit with --resume")
    ] = None,
    replicas: Annotated[int | None, typer.Option(help="override diloco.replicas")] = None,
    set_: Annotated[list[str], typer.Option("--set", help="override any key: --set diloco.sync_every=20")] = [],  # noqa: B006
    resume: Annotated[
        str | None,
        typer.Option(help="continue the run at this store URL (e.g. runs/<run_id>) from its latest state"),
    ] = None,
) -> None:
    """Validate the config, create the run in the store, start the replicas and watch them to the end.

    With --resume RUN, restart the replicas of an existing run instead: they continue from its latest
    published state and their own saved state, with the configuration the run was created with.
    """
    from composer_serverless.launcher import RunFailed
    from composer_serverless.launcher import launch as run_launch
    from composer_serverless.launcher import resume as run_resume

    overrides = [*set_, *([f"diloco.replicas={replicas}"] if replicas is not None else [])]
    try:
        if resume is not None:
            if config is not None or overrides:
                raise ConfigError("--resume continues a run as it was created: pass no CONFIG, --set or --replicas")
            run_resume(resume, console)
        elif config is None:
            raise ConfigError("pass a CONFIG to start a run, or --resume RUN to continue one")
        else:
            run_launch(load_config(config, overrides), str(config), console)
    except (ConfigError, StoreError) as e:
        err_console.print(f"[red]error:[/] {e}", highlight=False)
        raise typer.Exit(2) from None
    except RunFailed as e:
        err_console.print(f"[red]run failed:[/] {e}", highlight=False)
        raise typer.Exit(1) from None


def main() -> None:
    app()
