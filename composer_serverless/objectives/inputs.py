"""A run's training inputs, read and checked: by the launcher before any replica is paid for, and by each
replica's objective when it starts.

Everything a replica would otherwise find wrong only once it runs is found here: a data file or dataset that
is missing or has a malformed record (named by file and line), a mapped column a row lacks, a column a
built-in reward reads that no record has, fewer records than replicas, a global batch the text corpus cannot
feed. User reward functions are imported and called by ``reward_check.py``, in a child process of the
launcher: nothing here imports the user's code or a tensor library, so the launcher's checks cost no torch
import.
"""

from __future__ import annotations

import glob
import os

from composer_serverless.config import ComposerConfig, ConfigError, RunConfig
from composer_serverless.config.composer import BUILTIN_COLUMNS, BUILTIN_REWARDS
from composer_serverless.data.corpus import documents
from composer_serverless.data.records import PromptRecord, is_dataset, read_pairs, read_prompts, shard_records

# What a data setting that names nothing on this machine is told: the rule that made its path (``config/paths.py``).
PATH_FIX = (
    "a relative path in a config file is relative to that file's directory, one given with --set to the "
    "working directory; correct it, or give an absolute path"
)


def check(config: RunConfig) -> list[PromptRecord]:
    """Check the inputs of ``config``'s objective; the composer objective's training prompts (none for lm).

    Raises:
        ConfigError: naming what is wrong and where.
    """
    train: list[PromptRecord] = []
    if config.train.objective == "composer":
        train = check_composer(config)
    else:
        check_text(config)
    chat = (config.data.format == "chat" and not config.data.is_stdlib) or (
        config.composer is not None and config.composer.chat_template
    )
    if chat and config.model.tiny is not None:
        raise ConfigError(
            "the tiny model's tokenizer has no chat template, so chat records or chat prompts cannot be "
            "rendered\n  fix: model.path = a chat model, or data.format = 'text' / composer.chat_template = false"
        )
    return train


def check_composer(config: RunConfig) -> list[PromptRecord]:
    """Read every data file of the composer objective and check it carries what the rewards read; the
    training prompts.

    Raises:
        ConfigError: a file is missing or has a malformed record (named by file and line), a built-in reward
            reads a column no record has, or there are fewer records than replicas.
    """
    composer = composer_table(config)
    data = composer.data
    pairs = data.pairs if composer.replay_on else None  # pairs with beta = 0 are left unread
    check_paths(
        {
            "composer.data.prompts": data.prompts,
            "composer.data.heldout": data.heldout,
            "composer.data.pairs": pairs,
        }
    )
    try:
        train, heldout = read_prompt_sets(composer)
        check_columns(composer, train, heldout)
        shard_records(train, 0, config.diloco.replicas)
        if composer.data.pairs is not None and composer.replay_on:
            shard_records(read_pairs(composer.data.pairs), 0, config.diloco.replicas)
    except (OSError, ValueError) as e:  # RecordError is a ValueError
        raise ConfigError(f"[composer] inputs: {e}") from e
    return train


def check_text(config: RunConfig) -> None:
    """Read the lm objective's documents and refuse what would fail only once replicas run: a record without
    its field, and a global batch the documents cannot feed (each of its streams reads documents of its own,
    ``data.Batches``), or no held-out document to evaluate on.

    Raises:
        ConfigError: naming the record, or the numbers and the fix.
    """
    data = config.data
    if not data.is_stdlib:
        check_paths({"data.corpus": data.corpus, "data.heldout": data.heldout})
    try:
        corpus = documents(data)
    except (OSError, ValueError) as e:  # RecordError is a ValueError
        raise ConfigError(f"data: {e}") from e
    streams = config.diloco.replicas * data.batch_size * data.streams_per_row
    train = len(corpus.train)
    if streams > train:
        raise ConfigError(
            f"data: {config.diloco.replicas} replicas x batch_size {data.batch_size} x streams_per_row "
            f"{data.streams_per_row} = {streams} streams, but the {data.corpus} corpus has {train} train "
            "documents and each stream needs at least one\n  fix: lower data.batch_size or data.streams_per_row"
        )
    if not corpus.heldout:
        raise ConfigError(
            f"data: none of the {train} documents of {data.corpus} is held out for evaluation\n"
            "  fix: set data.heldout to files of held-out records, or raise data.heldout_percent"
        )


def check_paths(named: dict[str, str | None]) -> None:
    """Refuse a data setting whose path on this machine names nothing (a glob: matches nothing), with the
    absolute path tried; URLs are left to their readers.

    Raises:
        ConfigError: naming the key, the absolute path and the rule paths follow.
    """
    for key, value in named.items():
        if value is None or "://" in value:
            continue
        path = os.path.abspath(os.path.expanduser(value))
        pattern = any(c in value for c in "*?[")
        if glob.glob(path) if pattern else os.path.exists(path):
            continue
        what = "no file matches" if pattern else "no such file or directory:"
        raise ConfigError(f"{key}: {what} {path}\n  fix: {PATH_FIX}")


def composer_table(config: RunConfig) -> ComposerConfig:
    if config.composer is None:
        raise ValueError("the composer objective needs the [composer] table")
    return config.composer


def read_prompt_sets(composer: ComposerConfig) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """The training and held-out prompts, their columns renamed by the column map (a Hugging Face dataset's
    configured splits)."""
    return read_prompt_set(composer, heldout=False), read_prompt_set(composer, heldout=True)


def read_prompt_set(
    composer: ComposerConfig, *, heldout: bool, limit: int | None = None
) -> list[PromptRecord]:
    """The training (or held-out) prompts, the first ``limit`` of them when given."""
    data = composer.data
    url, split = (data.heldout, data.heldout_split) if heldout else (data.prompts, data.train_split)
    if is_dataset(url):
        return read_prompts(url, data.columns, split=split, subset=data.subset, limit=limit)
    return read_prompts(url, data.columns, limit=limit)


def check_columns(composer: ComposerConfig, train: list[PromptRecord], heldout: list[PromptRecord]) -> None:
    """Refuse a built-in reward whose column no record of a set has (each row without it then scores None,
    as a TRL reward does for a row it does not apply to).

    Raises:
        ValueError: naming the reward, the column and the file, with the column map as the fix.
    """
    for reward in composer.rewards:
        column = BUILTIN_COLUMNS.get(reward.fn)
        if column is None:
            continue
        for records, url in ((train, composer.data.prompts), (heldout, composer.data.heldout)):
            if not any(r.columns.get(column) for r in records):
                raise ValueError(
                    f"reward {reward.fn!r} reads the {column!r} column, which no record of {url} has\n"
                    f'  fix: map the column that holds it: [composer.data.columns] {column} = "<its name>"'
                )


def sdpo_weight(composer: ComposerConfig, train: list[PromptRecord], feedback: bool) -> float:
    """``composer.alpha``, 'auto' resolved: 1 when the task gives feedback for SDPO's hints (``feedback``: a
    reward of non-zero weight returned some; the built-ins do, as does the built-in environment at its error
    sites), or its prompts carry a ``hint`` column; else 0.
    A reward of weight 0 is an evaluation metric, whose feedback no hint shows."""
    if composer.alpha != "auto":
        return composer.alpha
    builtin = any(r.fn in BUILTIN_REWARDS and r.weight != 0 for r in composer.rewards) or (
        composer.episodes is not None and composer.episodes.builtin is not None  # hints at its error sites
    )
    hinted = any(r.hint for r in train)
    return 1.0 if feedback or builtin or hinted else 0.0
