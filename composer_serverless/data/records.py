"""The JSONL records of the composer objective (RL prompts, preference pairs), and an endless seeded order
over them.

The readers go through fsspec, so a local path, ``s3://``, ``hf://`` or a glob all work, and a record that
cannot be used is reported with its file and line number before anything trains on it (the launcher reads
every file before any replica starts; nothing here needs a tensor library).
"""

from __future__ import annotations

import contextlib
import difflib
import gzip
import io
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

PROMPT_KEYS = ("prompt", "answer", "tests", "hint", "task", "meta")
# ``provenance``: where a harvested pair came from (its teachers, their answers, agreement, cost); not read.
PAIR_KEYS = ("prompt", "chosen", "rejected", "chosen_ref_logp", "rejected_ref_logp", "provenance")


class RecordError(ValueError):
    """A JSONL record that cannot be used; the message starts with ``file:line``."""


@dataclass(frozen=True)
class PromptRecord:
    """One RL prompt and what its rewards need.

    Attributes:
        prompt: the text the model continues (no chat template is applied; render one into the file).
        answer: the expected completion, for ``exact_match``.
        tests: Python test snippets (asserts) run after the completion's code, for ``unit_tests``.
        hint: a fixed hint for the SDPO teacher, shown whatever the rollout's outcome.
        task: a label; evaluation reports the reward per task.
        meta: any JSON value, passed untouched to user reward functions.
        source: ``file:line`` of the record, for error messages.
    """

    prompt: str
    answer: str | None = None
    tests: tuple[str, ...] = ()
    hint: str | None = None
    task: str = "default"
    meta: Any = None
    source: str = ""


@dataclass(frozen=True)
class PreferencePair:
    """Two completions of one prompt, the chosen one preferred; both scored as completions ending in EOS.

    Attributes:
        chosen_ref_logp / rejected_ref_logp: log pi_ref of the completion (its tokens and the EOS after
            them) given the prompt, summed, at temperature 1 under the run's tokenizer; both or neither. When
            absent, DPO computes them once with the initial model.
    """

    prompt: str
    chosen: str
    rejected: str
    chosen_ref_logp: float | None = None
    rejected_ref_logp: float | None = None
    source: str = ""


def read_prompts(url: str) -> list[PromptRecord]:
    """Every prompt record of the file(s) at ``url`` (JSONL or Parquet; a path, an fsspec URL or a glob), in
    file order.

    Raises:
        RecordError: a line is not a JSON object, a key is unknown or a value has the wrong type.
        FileNotFoundError: nothing matches ``url``.
    """
    return [_prompt_record(obj, where) for obj, where in read_rows(url)]


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


def read_rows(url: str) -> Iterator[tuple[dict[str, Any], str]]:
    """Every row of the file(s) at ``url`` (a path, an fsspec URL or a glob) as (row, ``file:line``), in file
    order: JSON lines (gzipped ones too: the compression is inferred from the name) or Parquet (``file:row``,
    1-based, as a line number would be).

    Raises:
        FileNotFoundError: nothing matches ``url``.
        RecordError: a line is not a JSON object, or the files hold no rows.
    """
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    # A filesystem of its own, as the store's: a cached one may hold an endpoint or credentials of the past.
    files = fsspec.open_files(url, mode="rb", skip_instance_cache=True)
    if not files:
        raise FileNotFoundError(f"no file matches {url}")
    count = 0
    for file in files:
        # Local files by their path, remote ones by their URL (s3://bucket/key), as the user wrote them.
        name = file.path if isinstance(file.fs, LocalFileSystem) else file.fs.unstrip_protocol(file.path)
        rows = _parquet_rows(file) if name.endswith(".parquet") else json_lines(file, name)
        for number, obj in rows:
            count += 1
            yield obj, f"{name}:{number}"
    if not count:
        raise RecordError(f"{url}: no records")


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


def _parquet_rows(file: Any) -> Iterator[tuple[int, dict[str, Any]]]:
    import pyarrow.parquet as pq

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


def _prompt_record(obj: dict[str, Any], where: str) -> PromptRecord:
    _check_keys(obj, PROMPT_KEYS, where)
    tests = obj.get("tests", ())
    if isinstance(tests, str):
        tests = (tests,)
    if not isinstance(tests, (list, tuple)) or not all(isinstance(t, str) and t.strip() for t in tests):
        raise RecordError(f"{where}: 'tests' must be a string or a list of non-empty strings of Python code")
    return PromptRecord(
        prompt=_text(obj, "prompt", where, required=True),
        answer=_text(obj, "answer", where, required=False),
        tests=tuple(tests),
        hint=_text(obj, "hint", where, required=False),
        task=_text(obj, "task", where, required=False) or "default",
        meta=obj.get("meta"),
        source=where,
    )


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
    pair = PreferencePair(
        prompt=_text(obj, "prompt", where, required=True),
        chosen=_text(obj, "chosen", where, required=True),
        rejected=_text(obj, "rejected", where, required=True),
        chosen_ref_logp=_ref_logp(obj, "chosen_ref_logp", where),
        rejected_ref_logp=_ref_logp(obj, "rejected_ref_logp", where),
        source=where,
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
