"""A run's model out of the store: ``export`` (any kept checkpoint or ``final/``, in a dtype, with its model
card, optionally pushed to the Hub), and the launcher's push at the end of a run (``[output]``).

What is exported: by default ``final/`` (the last round's publisher writes it when the run completes), and
for a run without one (it died in round 30 of 40, or still runs) its newest kept checkpoint; ``round_index``
picks any checkpoint the run keeps (``latest.kept_checkpoints``), rebuilt from its global state by
``replicas/round_model.py`` (with the run's key, for an authenticated run). A LoRA run's model is the base
with the adapters merged in, the adapters themselves in ``OUT/adapter``. Everything that can be wrong (the
dtype, the round, OUT, the repo, the token, the run key) is found before anything is written.

The training stack is imported only once a model is written, so the launcher's side stays free of it.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from rich.console import Console

from composer_serverless.config import ConfigError, ModelConfig, RunConfig
from composer_serverless.config.model import dtype_name
from composer_serverless.config.outputs import OutputConfig
from composer_serverless.executors.base import BackendError
from composer_serverless.executors.environment import secret_value
from composer_serverless.executors.opening import RUN_URL_HINT, open_created
from composer_serverless.outputs import hub
from composer_serverless.outputs.model_card import card_text
from composer_serverless.rendezvous import latest, layout
from composer_serverless.rendezvous.run_keys import checked_run_key
from composer_serverless.rendezvous.runkey import RunKey
from composer_serverless.rendezvous.store import ObjectStore

# The dtypes an export can write the weights in: those a run can hold them in.
EXPORT_DTYPES: tuple[str, ...] = get_args(ModelConfig.model_fields["dtype"].annotation)
CARD = "README.md"


def _export_dtype(text: str) -> str:
    """``--dtype`` as a dtype the weights can be written in, TRL's spellings (bf16, fp32) included."""
    try:
        name = dtype_name(text)
    except ValueError as e:
        raise ConfigError(f"--dtype {e}\n  fix: one of {', '.join(EXPORT_DTYPES)} (or bf16, fp32)") from None
    if name not in EXPORT_DTYPES:
        raise ConfigError(
            f"--dtype {text!r} is not a dtype the weights can be exported in\n"
            f"  fix: one of {', '.join(EXPORT_DTYPES)} (or bf16, fp32; bfloat16: half the size of float32)"
        )
    return name


@dataclass(frozen=True)
class Source:
    """What an export writes: the model after ``round``, from ``final/`` or from that round's checkpoint;
    ``kept`` are the checkpoints the run keeps, newest first."""

    round: int
    final: bool
    kept: tuple[int, ...]


@dataclass(frozen=True)
class Exported:
    source: Source
    commit_url: str | None


def export(
    url: str,
    out: Path,
    *,
    round_index: int | None = None,
    dtype: str | None = None,
    push_to_hub: str | None = None,
    private: bool = True,
    endpoint: str | None = None,
) -> Exported:
    """Write the run's model after ``round_index`` (default: ``final/``, else the newest checkpoint) to
    ``out`` in Hugging Face format with its model card, the weights in ``dtype`` (one of ``EXPORT_DTYPES``;
    default as trained); with ``push_to_hub``, then commit it to that Hub repo, created private unless
    ``private`` is false. ``endpoint`` is the Hub's (huggingface_hub's default when None).

    Raises:
        ConfigError: a wrong argument, a round the run does not keep, a non-empty ``out``, no token, a wrong
            run key, or a state that cannot be read; nothing was written.
        BackendError: the Hub refused or failed (the token is checked before anything is written).
    """
    if dtype is not None:
        dtype = _export_dtype(dtype)
    store, config = open_created(url)
    source = choose(store, config, round_index)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} exists and is not empty\n  fix: choose a new directory")
    token = None if push_to_hub is None else _push_token(push_to_hub)
    key = None if source.final else _run_key(store, config)
    if push_to_hub is not None and token is not None:
        hub.check_access(token, push_to_hub, private=private, endpoint=endpoint)
    _write_model(store, config, source, out, dtype, key)
    card = card_text(
        config,
        _summary(store),
        round_index=source.round,
        final=source.final,
        title=push_to_hub or str(config.run_id),
    )
    (out / CARD).write_text(card)
    if push_to_hub is None or token is None:
        return Exported(source, None)
    message = f"Round {source.round} of run {config.run_id}, trained with DiLoCo by composer-serverless"
    try:
        commit = hub.push(out, push_to_hub, private=private, token=token, message=message, endpoint=endpoint)
    except BackendError as e:
        flags = (
            (f" --round {round_index}" if round_index is not None else "")
            + (f" --dtype {dtype}" if dtype is not None else "")
            + ("" if private else " --public")
        )
        raise BackendError(
            f"{e}\n  a push is one commit: {push_to_hub} holds all of this model or none of it; push it again "
            f"with `composer-serverless export {url} <new dir> --push-to-hub {push_to_hub}{flags}`",
            e.exit_code,
        ) from None
    return Exported(source, commit)


def choose(store: ObjectStore, config: RunConfig, round_index: int | None) -> Source:
    """The model to export: round ``round_index``'s checkpoint, or by default ``final/`` if the run has one
    of its last round, else its newest checkpoint. ``final/`` is of the last round only once the run got there:
    a resume that takes a finished run further (``--set diloco.rounds``) leaves the old end's until the new
    one. ConfigError names the rounds there are when the one asked for is not kept."""
    kept = tuple(latest.kept_checkpoints(store))
    has_final = bool(store.list(layout.FINAL)) and _reached_the_end(store, config)
    if round_index is None and has_final:
        return Source(config.diloco.rounds, True, kept)
    if round_index is None and kept:
        return Source(kept[0], False, kept)
    if round_index is None:
        raise ConfigError(
            f"{store.url} has no model yet: no {layout.FINAL}/ (written when the run completes) and no "
            f"checkpoint (every diloco.checkpoint_every = {config.diloco.checkpoint_every} rounds)\n"
            f"  fix: wait for its first checkpoint (`composer-serverless status {store.url}`); {RUN_URL_HINT}"
        )
    if round_index not in kept:
        available = ", ".join(map(str, kept)) if kept else "none yet"
        raise ConfigError(
            f"--round {round_index}: the run keeps the checkpoints of rounds {available}"
            + (f" (and {layout.FINAL}/, exported without --round)" if has_final else "")
            + f"; older ones are deleted (diloco.keep_checkpoints = {config.diloco.keep_checkpoints})\n"
            "  fix: --round one of those"
        )
    return Source(round_index, False, kept)


def _reached_the_end(store: ObjectStore, config: RunConfig) -> bool:
    """Whether the run got to its last round: lock-step's ``state/LATEST`` names it, or in decoupled mode
    (which publishes versions, not rounds) the syncer committed its last global version."""
    if config.diloco.mode == "decoupled":
        return store.exists(layout.version(config.diloco.rounds))
    return latest.latest_round(store) >= config.diloco.rounds


def _push_token(repo: str) -> str:
    problem = hub.repo_problem(repo)
    if problem is not None:
        raise ConfigError(f"--push-to-hub {problem}\n  fix: use <user-or-org>/<name>")
    token = secret_value("HF_TOKEN")
    if token is None:
        raise ConfigError(f"--push-to-hub needs a Hugging Face token\n  fix: {hub.TOKEN_FIX}")
    return token


def _run_key(store: ObjectStore, config: RunConfig) -> RunKey | None:
    """The key an authenticated run's replicas MAC its states with (the run key bound to the run id), found
    as ``launch --resume`` finds it and checked against the run's fingerprint; None for a run without one."""
    if not config.diloco.authenticate:
        return None
    return checked_run_key(store, then="export again").for_run(str(config.run_id))


def _write_model(
    store: ObjectStore, config: RunConfig, source: Source, out: Path, dtype: str | None, key: RunKey | None
) -> None:
    """The model of ``source`` into ``out``: ``final/`` as it is, or first into a scratch directory (a round's
    checkpoint rebuilt, or ``final/`` to cast or merge), so a state that cannot be read leaves ``out`` alone."""
    lora = config.model.lora is not None
    if source.final and not lora and dtype is None:
        store.download_dir(layout.FINAL, out)
        return
    from composer_serverless.models import loading

    with (
        loading.no_progress_bars(),
        tempfile.TemporaryDirectory(prefix="composer-serverless-export-") as scratch,
    ):
        model = Path(scratch) / "model"
        if source.final:
            store.download_dir(layout.FINAL, model)
        else:
            _save_round(store, config, source, model, key)
        if lora:
            from composer_serverless.replicas.weights import model_source

            base = str(model_source(store, config, Path(scratch) / "base"))  # a Hub id, or the run's model/
            loading.merge_adapters(config.model, base, model, out, dtype)
            shutil.copytree(model, out / "adapter")
        elif dtype is not None:
            loading.save_in_dtype(config.model, model, out, dtype)
        else:
            shutil.copytree(model, out, dirs_exist_ok=True)


def _save_round(store: ObjectStore, config: RunConfig, source: Source, out: Path, key: RunKey | None) -> None:
    from composer_serverless.rendezvous.checkpoint import CheckpointError
    from composer_serverless.replicas.round_model import save_round

    others = ", ".join(str(k) for k in source.kept if k != source.round) or "none"
    try:
        save_round(store, config, source.round, out, key)
    except FileNotFoundError as e:
        raise ConfigError(
            f"round {source.round}'s checkpoint is no longer whole in the store ({e}): deleted meanwhile?\n"
            f"  fix: --round one of the other kept rounds ({others})"
        ) from None
    except CheckpointError as e:
        raise ConfigError(
            f"round {source.round}'s checkpoint cannot be exported: {e}\n"
            f"  fix: --round one of the other kept rounds ({others})"
        ) from None


def _summary(store: ObjectStore) -> dict[str, Any] | None:
    """The run's ``summary.json``, or None before it is written."""
    try:
        return json.loads(store.get(layout.SUMMARY))
    except FileNotFoundError:
        return None


def push_problems(output: OutputConfig) -> list[str]:
    """What is wrong for ``[output]``'s push at the end of a run, told before the run starts rather than after
    hours of training: the repo id, and the Hub token this machine lacks (no network: whether the Hub takes
    the token is known at the end)."""
    repo = output.push_to_hub
    if repo is None:
        return []
    problems = []
    problem = hub.repo_problem(repo)
    if problem is not None:
        problems.append(f"output.push_to_hub: {problem}\n  fix: use <user-or-org>/<name>")
    if secret_value("HF_TOKEN") is None:
        problems.append(
            f"output.push_to_hub = {repo!r} pushes the model when the run ends, and this machine has no Hugging "
            f"Face token (HF_TOKEN is not set, nor saved by `hf auth login`)\n  fix: {hub.TOKEN_FIX}; or leave "
            "output.push_to_hub unset and push later with `composer-serverless export RUN OUT --push-to-hub REPO`"
        )
    return problems


def publish(run_url: str, output: OutputConfig, console: Console) -> str:
    """The launcher's push at the end of a run that succeeded (``[output]``): the final model exported to a
    scratch directory in ``output.dtype``, with its card, committed to ``output.push_to_hub``. A failure says
    how to push again: the model stays in the run."""
    repo = output.push_to_hub
    assert repo is not None
    with tempfile.TemporaryDirectory(prefix="composer-serverless-push-") as out:
        try:
            with console.status(f"pushing the final model to {repo}"):
                exported = export(
                    run_url, Path(out), dtype=output.dtype, push_to_hub=repo, private=output.private
                )
        except (ConfigError, BackendError) as e:
            raise BackendError(
                f"the run succeeded and its report is written, but its model was not pushed to {repo}: {e}",
                getattr(e, "exit_code", 2),
            ) from None
    assert exported.commit_url is not None
    console.print(
        f"pushed the final model to {repo}: {exported.commit_url}",
        highlight=False,
    )
    return exported.commit_url
