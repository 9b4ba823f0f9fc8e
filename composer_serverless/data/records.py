"""The records of the composer objective (RL prompts, preference pairs), read as TRL reads a dataset, and an
endless seeded order over them.

A prompt record is a dataset row: its ``prompt`` (a string, or a conversation: a list of ``{"role",
"content"}`` messages, system turns included, that the chat template renders) and every other column, by
name. A column map renames columns first (``composer.data.columns``: ``prompt = "question"``). Rewards get
every column (``rewards.py``); the built-in rewards read ``answer`` and ``tests``, SDPO reads ``hint``, and
evaluation reports per ``task``: ordinary columns, none of them required.

The readers go through fsspec, so a local path, ``s3://``, ``hf://`` or a glob all work, for JSON lines and
Parquet; a Hugging Face dataset (``hf://datasets/OWNER/NAME``, or a directory of one on this machine) is read
through ``datasets``, a split of it. A record that cannot be used is reported with its file and line (or
split and row) before anything trains on it (the launcher reads every file before any replica starts;
nothing here needs a tensor library).
"""

from __future__ import annotations

import contextlib
import difflib
import gzip
import io
import itertools
import json
import math
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# ``provenance``: where a harvested pair came from (its teachers, their answers, agreement, cost); not read.
PAIR_KEYS = ("prompt", "chosen", "rejected", "chosen_ref_logp", "rejected_ref_logp", "provenance", "tools")
# What a reward function is called with besides the columns (TRL's names, and ``truncated``): no column may
# take them.
RESERVED_COLUMNS = ("prompts", "completions", "completion_ids", "truncated", "trainer_state")
ROLES = ("system", "user", "assistant", "tool")
# The task of a row without a ``task`` value: evaluation's per-task figures name the group of such rows so.
NO_TASK = "default"
# The extras that bring the optional readers, for the install line of a missing one.
PARQUET_EXTRA = "pip install 'composer-serverless[parquet]'  (pyarrow)"
DATASETS_EXTRA = "pip install 'composer-serverless[hf]'  (datasets, huggingface_hub)"


class RecordError(ValueError):
    """A record that cannot be used; the message starts with where it is (``file:line``, ``dataset[split]:row``)."""


Prompt = str | tuple[dict[str, str], ...]


@dataclass(frozen=True)
class PromptRecord:
    """One RL prompt: a dataset row.

    Attributes:
        prompt: the text the model continues, or a conversation (messages, system turns kept) the tokenizer's
            chat template renders up to the assistant's turn.
        columns: every other column of the row by name (after the column map), as reward functions get them.
        source: where the row is (``file:line``, or ``dataset[split]:row``), for error messages.
    """

    prompt: Prompt
    columns: Mapping[str, Any] = field(default_factory=dict)
    source: str = ""

    @property
    def conversational(self) -> bool:
        return not isinstance(self.prompt, str)

    @property
    def key(self) -> str:
        """The prompt as one string: text as it is, a conversation as JSON (a key for records and dedup)."""
        return self.prompt if isinstance(self.prompt, str) else json.dumps(list(self.prompt), sort_keys=True)

    @property
    def answer(self) -> str | None:
        """The ``answer`` column (``exact_match`` compares completions with it)."""
        value = self.columns.get("answer")
        return None if value is None else str(value)

    @property
    def tests(self) -> tuple[str, ...]:
        """The ``tests`` column: Python snippets (asserts) ``unit_tests`` runs against the completion's code."""
        value = self.columns.get("tests")
        if value is None:
            return ()
        return (value,) if isinstance(value, str) else tuple(value)

    @property
    def hint(self) -> str | None:
        """The ``hint`` column: shown to the SDPO teacher whatever the rollout's outcome."""
        value = self.columns.get("hint")
        return value or None

    @property
    def task(self) -> str:
        """The ``task`` column (evaluation reports the reward per task), ``NO_TASK`` without one."""
        value = self.columns.get("task")
        return NO_TASK if value is None else str(value)


def task_label(task: str) -> str:
    """A task group as a report names it: the rows without a task as such, not by their group's key (a user
    reading "default" would look for a task of that name)."""
    return "rows without a task" if task == NO_TASK else task


@dataclass(frozen=True)
class PreferencePair:
    """Two completions of one prompt, the chosen one preferred; both scored as completions ending in EOS.

    Attributes:
        chosen_ref_logp / rejected_ref_logp: log pi_ref of the completion (its tokens and the EOS after
            them) given the prompt, summed, at temperature 1 under the run's tokenizer; both or neither. When
            absent, DPO computes them once with the initial model.
        prompt: the text, or the conversation a trace's state holds (a per-state pair of an episode).
        tools: the tools' JSON schemas the conversation is rendered with (the chat template's ``tools=``).
    """

    prompt: Prompt
    chosen: str
    rejected: str
    chosen_ref_logp: float | None = None
    rejected_ref_logp: float | None = None
    source: str = ""
    tools: tuple[dict[str, Any], ...] = ()


def read_prompts(
    url: str,
    columns: Mapping[str, str] | None = None,
    split: str | None = None,
    subset: str | None = None,
    limit: int | None = None,
) -> list[PromptRecord]:
    """Every prompt record of the file(s) or dataset at ``url``, in order (the first ``limit`` when given).

    Args:
        columns: renames (our name -> the dataset's column), applied to every row first.
        split, subset: of a Hugging Face dataset (``read_rows``).

    Raises:
        RecordError: a mapped column is missing, the prompt is missing or malformed, or a column the built-ins
            read has the wrong type.
        FileNotFoundError: nothing matches ``url``.
    """
    renames = dict(columns or {})
    rows = itertools.islice(read_rows(url, split=split, subset=subset), limit)
    return [_prompt_record(obj, where, renames) for obj, where in rows]


def read_pairs(url: str) -> list[PreferencePair]:
    """Every preference pair of the JSONL file(s) at ``url``; errors as ``read_prompts``."""
    return [_pair_record(obj, where) for obj, where in read_rows(url)]


def pairs_from_jsonl(data: bytes, name: str) -> list[PreferencePair]:
    """The pairs of one JSON-lines object read from a store (``name`` for messages); none if it is empty."""
    return [_pair_record(obj, f"{name}:{n}") for n, obj in json_lines(io.BytesIO(data), name)]


def shard_records(records: list[Any], rank: int, replicas: int) -> list[Any]:
    """Record i goes to rank ``i % replicas``: disjoint shards that each mix a file sorted by task."""
    if len(records) < replicas:
        raise ValueError(f"{len(records)} records cannot be sharded over {replicas} replicas (each needs 1)")
    return records[rank::replicas]


def read_rows(
    url: str, *, split: str | None = None, subset: str | None = None
) -> Iterator[tuple[dict[str, Any], str]]:
    """Every row of the file(s) at ``url`` (a path, an fsspec URL or a glob) as (row, ``file:line``), in file
    order: JSON lines (gzipped ones too: the compression is inferred from the name) or Parquet (``file:row``,
    1-based, as a line number would be). A Hugging Face dataset (``hf://datasets/OWNER/NAME``, or a local
    directory holding one) is read through ``datasets``: rows of ``split`` (default "train") of its
    configuration ``subset``, as (row, ``name[split]:row``).

    Raises:
        FileNotFoundError: nothing matches ``url``.
        RecordError: a line is not a JSON object, the files hold no rows, or a reader is not installed (its
            install line in the message).
    """
    if is_dataset(url):
        yield from _dataset_rows(url, split or "train", subset)
        return
    if split is not None or subset is not None:
        raise RecordError(f"{url}: a split or subset applies to a Hugging Face dataset, not to files")
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    # A filesystem of its own, as the store's: a cached one may hold an endpoint or credentials of the past.
    try:
        files = fsspec.open_files(url, mode="rb", skip_instance_cache=True)
    except ImportError as e:  # hf:// without huggingface_hub, s3:// without s3fs
        extra = DATASETS_EXTRA if url.startswith("hf://") else "pip install 'composer-serverless[s3]' (s3fs)"
        raise RecordError(
            f"{url}: reading it needs a package that is not installed ({e})\n  fix: {extra}"
        ) from None
    if not files:
        raise FileNotFoundError(f"no file matches {url}")
    count = 0
    for file in files:
        # Local files by their path, remote ones by their URL (s3://bucket/key), as the user wrote them.
        name = file.path if isinstance(file.fs, LocalFileSystem) else file.fs.unstrip_protocol(file.path)
        rows = _parquet_rows(file, name) if name.endswith(".parquet") else json_lines(file, name)
        for number, obj in rows:
            count += 1
            yield obj, f"{name}:{number}"
    if not count:
        raise RecordError(f"{url}: no records")


def is_dataset(url: str) -> bool:
    """Whether ``url`` names a Hugging Face dataset (a repository on the Hub, or a directory on this machine)
    rather than data files."""
    if url.startswith("hf://datasets/"):
        return len(url.removeprefix("hf://datasets/").strip("/").split("/")) == 2 and "*" not in url
    return "://" not in url and Path(url).expanduser().is_dir()


def _dataset_rows(url: str, split: str, subset: str | None) -> Iterator[tuple[dict[str, Any], str]]:
    try:
        import datasets
    except ImportError:
        raise RecordError(
            f"{url}: a Hugging Face dataset is read with the datasets package, which is not installed\n  fix: {DATASETS_EXTRA}"
        ) from None
    hub = url.startswith("hf://")
    name = url.removeprefix("hf://datasets/").strip("/") if hub else url
    local = Path(url).expanduser()
    try:
        if hub:
            loaded = datasets.load_dataset(name, subset, split=split)
        elif (local / "dataset_dict.json").exists():  # saved with save_to_disk: its splits
            loaded = datasets.load_from_disk(str(local))[split]
        elif (local / "dataset_info.json").exists():  # one split saved with save_to_disk
            loaded = datasets.load_from_disk(str(local))
        else:  # data files in a directory
            loaded = datasets.load_dataset(str(local), subset, split=split)
    except (KeyError, ValueError) as e:  # an unknown split or configuration
        raise RecordError(
            f"{url}: cannot read split {split!r}{'' if subset is None else f' of {subset!r}'}: {e}"
        ) from None
    if len(loaded) == 0:
        raise RecordError(f"{url}[{split}]: no records")
    for index, row in enumerate(loaded):
        yield dict(row), f"{name}[{split}]:{index}"


def json_lines(file: Any, name: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) of every non-blank line of the JSON-lines ``file`` (an fsspec file or a binary
    buffer; gzipped when ``name`` ends in ``.gz``), each checked to be a JSON object (RecordError)."""
    with file as raw, gzip.open(raw) if name.endswith(".gz") else contextlib.nullcontext(raw) as binary:
        for number, line in enumerate(io.TextIOWrapper(binary, encoding="utf-8"), start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise RecordError(f"{name}:{number}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise RecordError(f"{name}:{number}: expected a JSON object, got {type(obj).__name__}")
            yield number, obj


def _parquet_rows(file: Any, name: str) -> Iterator[tuple[int, dict[str, Any]]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise RecordError(
            f"{name}: Parquet is read with pyarrow, which is not installed\n  fix: {PARQUET_EXTRA}"
        ) from None

    with file as f:
        table = pq.read_table(f)
    yield from enumerate(table.to_pylist(), start=1)


def _check_keys(obj: dict[str, Any], known: tuple[str, ...], where: str) -> None:
    for key in obj:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(known)}"
            raise RecordError(f"{where}: unknown key {key!r}; {hint}")


def _text(obj: dict[str, Any], key: str, where: str, *, required: bool) -> str | None:
    value = obj.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value:
        shown = "missing" if key not in obj else f"got {json.dumps(value)}"
        raise RecordError(f"{where}: {key!r} must be a non-empty string ({shown})")
    return value


def _prompt_record(obj: dict[str, Any], where: str, renames: dict[str, str]) -> PromptRecord:
    row = dict(obj)
    for ours, theirs in renames.items():
        if theirs not in row:
            close = difflib.get_close_matches(theirs, list(row), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise RecordError(
                f"{where}: column {theirs!r} (mapped to {ours!r} by composer.data.columns) is not in this row; "
                f"{hint}its columns: {', '.join(row)}"
            )
        row[ours] = row.pop(theirs)
    if "prompt" not in row:
        raise RecordError(
            f"{where}: no 'prompt' column (its columns: {', '.join(row)})\n"
            '  fix: map the column that holds the prompt, e.g. [composer.data.columns] prompt = "question"'
        )
    prompt = _prompt(row.pop("prompt"), where)
    reserved = [c for c in row if c in RESERVED_COLUMNS]
    if reserved:
        raise RecordError(
            f"{where}: column {reserved[0]!r} would clash with what rewards are called with; rename it"
        )
    tests = row.get("tests")
    if tests is not None and not (
        (isinstance(tests, str) and tests.strip())
        or (isinstance(tests, (list, tuple)) and all(isinstance(t, str) and t.strip() for t in tests))
    ):
        raise RecordError(f"{where}: 'tests' must be a string or a list of non-empty strings of Python code")
    for text in ("answer", "hint", "task"):
        value = row.get(text)
        if value is None or (isinstance(value, (str, int, float)) and not isinstance(value, bool)):
            continue
        raise RecordError(f"{where}: {text!r} must be a string, got {json.dumps(value)}")
    return PromptRecord(prompt=prompt, columns=row, source=where)


def conversation(value: Any, where: str) -> Prompt:
    """A prompt (``_prompt``) whose tool turns keep the tool's ``name`` (the chat templates render it): what
    a trace's state and a per-state pair hold."""
    prompt = _prompt(value, where)
    if isinstance(prompt, str):
        return prompt
    named = [
        {**m, "name": given["name"]} if m["role"] == "tool" and isinstance(given.get("name"), str) else m
        for m, given in zip(prompt, value, strict=True)
    ]
    return tuple(named)


def _prompt(value: Any, where: str) -> Prompt:
    """A prompt string, or a conversation: messages with a known role and string content, the last not the
    assistant's (the model writes that turn)."""
    if isinstance(value, str):
        if not value:
            raise RecordError(f"{where}: 'prompt' is empty")
        return value
    if not isinstance(value, list) or not value:
        raise RecordError(
            f'{where}: \'prompt\' must be a string or a list of messages ({{"role": ..., "content": ...}}), '
            f"got {json.dumps(value)[:80]}"
        )
    messages = []
    for i, message in enumerate(value):
        if (
            not isinstance(message, dict)
            or message.get("role") not in ROLES
            or not isinstance(message.get("content"), str)
        ):
            raise RecordError(
                f'{where}: message {i} of \'prompt\' must be {{"role": one of {", ".join(ROLES)}, "content": '
                f"a string}}, got {json.dumps(message)[:80]}"
            )
        messages.append({"role": message["role"], "content": message["content"]})
    if messages[-1]["role"] == "assistant":
        raise RecordError(
            f"{where}: the prompt's last message is the assistant's; the model writes that turn"
        )
    return tuple(messages)


def _ref_logp(obj: dict[str, Any], key: str, where: str) -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value > 0:
        raise RecordError(f"{where}: {key!r} must be a finite log-probability <= 0, got {json.dumps(value)}")
    return float(value)


def _pair_record(obj: dict[str, Any], where: str) -> PreferencePair:
    _check_keys(obj, PAIR_KEYS, where)
    tools = obj.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise RecordError(f"{where}: 'tools' must be a list of JSON schemas (objects)")
    pair = PreferencePair(
        prompt=conversation(obj.get("prompt"), where),
        chosen=_text(obj, "chosen", where, required=True),
        rejected=_text(obj, "rejected", where, required=True),
        chosen_ref_logp=_ref_logp(obj, "chosen_ref_logp", where),
        rejected_ref_logp=_ref_logp(obj, "rejected_ref_logp", where),
        source=where,
        tools=tuple(tools),
    )
    if pair.chosen == pair.rejected:
        raise RecordError(f"{where}: chosen and rejected are the same text, so the pair teaches nothing")
    if (pair.chosen_ref_logp is None) != (pair.rejected_ref_logp is None):
        raise RecordError(f"{where}: give both chosen_ref_logp and rejected_ref_logp, or neither")
    return pair


class Cycle:
    """Endless passes over ``range(size)``, each epoch in a new seeded order; resumable from two integers."""

    def __init__(self, size: int, seed: int) -> None:
        if size < 1:
            raise ValueError("a cycle needs at least one item")
        self._size = size
        self._seed = seed
        self.load_state_dict({"epoch": 0, "index": 0})

    def take(self, count: int) -> list[int]:
        """The next ``count`` item indices (wrapping into the next epoch as needed)."""
        out = []
        for _ in range(count):
            if self._index == self._size:
                self.load_state_dict({"epoch": self._epoch + 1, "index": 0})
            out.append(self._order[self._index])
            self._index += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "index": self._index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._epoch, self._index = int(state["epoch"]), int(state["index"])
        self._order = list(range(self._size))
        random.Random(self._seed * 1_000_003 + self._epoch).shuffle(self._order)
