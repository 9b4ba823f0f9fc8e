"""A run's training inputs, read and checked: by the launcher before any replica is paid for, and by each
replica's objective when it starts.

Everything a replica would otherwise find wrong only once it runs is found here: a data file that is missing
or has a malformed record (named by file and line), a reward that does not import or needs a field a record
lacks, fewer records than replicas, a global batch the text corpus cannot feed. Nothing here needs a tensor
library, so the launcher's checks cost no torch import.
"""

from __future__ import annotations

from composer_serverless.config import ComposerConfig, ConfigError, RunConfig
from composer_serverless.data.corpus import documents
from composer_serverless.data.records import PromptRecord, read_pairs, read_prompts, shard_records
from composer_serverless.objectives.rewards import RewardSet


def check(config: RunConfig) -> None:
    """Check the inputs of ``config``'s objective.

    Raises:
        ConfigError: naming what is wrong and where.
    """
    if config.train.objective == "composer":
        check_composer(config)
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


def check_composer(config: RunConfig) -> None:
    """Read every data file and resolve every reward of the composer objective.

    Raises:
        ConfigError: a file is missing or has a malformed record (named by file and line), a reward does not
            import or needs a field a record lacks, or there are fewer records than replicas.
    """
    composer = composer_table(config)
    try:
        train, _ = checked_prompts(composer, RewardSet(composer.rewards))
        shard_records(train, 0, config.diloco.replicas)
        if composer.data.pairs is not None and composer.beta > 0:
            shard_records(read_pairs(composer.data.pairs), 0, config.diloco.replicas)
    except (OSError, ValueError) as e:  # RecordError and RewardError are ValueErrors
        raise ConfigError(f"[composer] inputs: {e}") from e


def check_text(config: RunConfig) -> None:
    """Read the lm objective's documents and refuse what would fail only once replicas run: a record without
    its field, and a global batch the documents cannot feed (each of its streams reads documents of its own,
    ``data.Batches``), or no held-out document to evaluate on.

    Raises:
        ConfigError: naming the record, or the numbers and the fix.
    """
    data = config.data
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


def composer_table(config: RunConfig) -> ComposerConfig:
    if config.composer is None:
        raise ValueError("the composer objective needs the [composer] table")
    return config.composer


def checked_prompts(
    composer: ComposerConfig, rewards: RewardSet
) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """The training and held-out prompts, checked to carry what the rewards need."""
    train, heldout = read_prompts(composer.data.prompts), read_prompts(composer.data.heldout)
    rewards.check(train)
    rewards.check(heldout)
    return train, heldout
