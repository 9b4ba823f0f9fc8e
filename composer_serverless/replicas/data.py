"""Training data, split among replicas: the text corpus of the causal-LM objective, and the JSONL records
of the composer objective (RL prompts, preference pairs).

The demo corpus is the Python standard library source of the running interpreter: real code nobody here
wrote, present on every machine that can run the project, so the demo needs no download. The split is by
file and by a hash of the file's path, so it is the same on every replica and every run, and no held-out
line is ever trained on.

The JSONL readers go through fsspec, so a local path, ``s3://``, ``hf://`` or a glob all work, and a record
that cannot be used is reported with its file and line number before anything trains on it.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import random
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Corpus:
    """Files of a text corpus under ``root``, split into train and held-out sets (paths relative to root)."""

    root: Path
    train: tuple[str, ...]
    heldout: tuple[str, ...]

    def read(self, rel: str) -> str:
        return (self.root / rel).read_text(encoding="utf-8", errors="replace")


def stdlib_corpus(heldout_percent: float) -> Corpus:
    """The standard library's ``.py`` files (site-packages excluded), split deterministically by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*.py")
        if "site-packages" not in p.parts and "__pycache__" not in p.parts
    )
    if not files:
        raise FileNotFoundError(
            f"no Python sources under {root}; the stdlib corpus needs the interpreter's sources"
        )
    cut = int(heldout_percent * 100)
    heldout = tuple(f for f in files if _bucket(f) < cut)
    train = tuple(f for f in files if _bucket(f) >= cut)
    return Corpus(root, train, heldout)


def _bucket(rel: str) -> int:
    return int.from_bytes(hashlib.sha256(rel.encode()).digest()[:4], "big") % 10_000


def shuffled(files: tuple[str, ...], seed: int) -> tuple[str, ...]:
    """The train files in a seeded order, so the streams dealt from it each mix the corpus' directories
    rather than taking one package each."""
    order = list(files)
    random.Random(seed).shuffle(order)
    return tuple(order)


class TokenStream:
    """Fixed-length token sequences packed from files, end-of-text between files; resumable.

    The position is (epoch, file index, token offset in that file): a few integers, so a restarted replica
    re-tokenizes one file and continues exactly where its checkpoint left it.
    """

    def __init__(
        self,
        corpus: Corpus,
        files: tuple[str, ...],
        tokenizer: Any,
        seq_len: int,
        *,
        seed: int,
        shuffle: bool = True,
    ) -> None:
        if not files:
            raise ValueError("a token stream needs at least one file")
        self._corpus = corpus
        self._files = files
        self._tokenizer = tokenizer
        self._seq_len = seq_len
        self._seed = seed
        self._shuffle = shuffle
        self.load_state_dict({"epoch": 0, "index": 0, "offset": 0})

    def _epoch_order(self) -> list[str]:
        order = list(self._files)
        if self._shuffle:
            random.Random(self._seed * 1_000_003 + self._epoch).shuffle(order)
        return order

    def _load_file(self) -> None:
        text = self._corpus.read(self._order[self._index])
        self._tokens = [*self._tokenizer(text)["input_ids"], self._tokenizer.eos_token_id]

    def _advance_file(self) -> None:
        self._index += 1
        self._offset = 0
        if self._index == len(self._order):
            self._epoch += 1
            self._index = 0
            self._order = self._epoch_order()
        self._load_file()

    def next_sequence(self) -> list[int]:
        sequence: list[int] = []
        while len(sequence) < self._seq_len:
            if self._offset == len(self._tokens):
                self._advance_file()
            take = self._tokens[self._offset : self._offset + self._seq_len - len(sequence)]
            sequence.extend(take)
            self._offset += len(take)
        return sequence

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "index": self._index, "offset": self._offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._epoch, self._index, self._offset = (
            int(state["epoch"]),
            int(state["index"]),
            int(state["offset"]),
        )
        self._order = self._epoch_order()
        self._load_file()


class Batches:
    """One replica's rows of a global batch whose rows come from independent streams over disjoint files.

    Packing consecutive sequences of one file into a batch would make its gradient as noisy as one file;
    dealing the files out to one stream per row keeps every batch a mix of files. The streams belong to the
    *global* batch of ``replicas * batch_size`` rows, and replica ``rank`` reads rows ``rank * batch_size``
    to ``(rank + 1) * batch_size - 1`` of it: so the union of N replicas' batches at a step is exactly the
    batch one process with ``N * batch_size`` rows reads at that step. A DiLoCo run and a data-parallel (or
    N = 1) run of the same global batch therefore train on the same tokens in the same order, and a
    comparison between them measures the method, not which files each happened to read.

    With ``streams_per_row`` = k, each global row g takes its sequences from k streams in turn (at step t,
    stream ``(t mod k) * rows + g``, where rows is the global batch's), so any k consecutive steps see k
    files per row: with one stream per row, a replica trains on the same ``batch_size`` files for tens of
    steps (a file holds tens of sequences).
    """

    def __init__(
        self,
        corpus: Corpus,
        files: tuple[str, ...],
        tokenizer: Any,
        seq_len: int,
        batch_size: int,
        *,
        seed: int,
        streams_per_row: int = 1,
        replicas: int = 1,
        rank: int = 0,
    ) -> None:
        if not 0 <= rank < replicas:
            raise ValueError(f"rank {rank} is not one of {replicas} replicas")
        rows = batch_size * replicas
        count = rows * streams_per_row
        if len(files) < count:
            raise ValueError(
                f"{len(files)} files cannot feed {rows} rows x {streams_per_row} streams per row "
                f"({replicas} replicas x {batch_size} rows); lower data.batch_size or data.streams_per_row"
            )
        self._batch_size = batch_size
        self._streams_per_row = streams_per_row
        # This replica's streams, turn by turn: turn j's rows are self._streams[j * batch_size:][:batch_size].
        mine = [j * rows + rank * batch_size + r for j in range(streams_per_row) for r in range(batch_size)]
        self._streams = [
            TokenStream(corpus, files[i::count], tokenizer, seq_len, seed=seed * 7919 + i) for i in mine
        ]
        self._step = 0

    def next(self) -> torch.Tensor:
        """The next ``(batch_size, seq_len)`` batch of token ids."""
        first = (self._step % self._streams_per_row) * self._batch_size
        self._step += 1
        rows = self._streams[first : first + self._batch_size]
        return torch.tensor([s.next_sequence() for s in rows], dtype=torch.long)

    def state_dict(self) -> dict[str, Any]:
        return {"streams": [s.state_dict() for s in self._streams], "step": self._step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for stream, stream_state in zip(self._streams, state["streams"], strict=True):
            stream.load_state_dict(stream_state)
        self._step = int(state.get("step", 0))


def training_text(corpus: Corpus, max_bytes: int, seed: int) -> Iterator[str]:
    """Train-split files in a seeded order until ``max_bytes`` of text, for fitting a tokenizer."""
    total = 0
    for rel in shuffled(corpus.train, seed):
        text = corpus.read(rel)
        yield text
        total += len(text)
        if total >= max_bytes:
            return


# --- JSONL records for the composer objective --------------------------------------------------------

PROMPT_KEYS = ("prompt", "answer", "tests", "hint", "task", "meta")
PAIR_KEYS = ("prompt", "chosen", "rejected", "chosen_ref_logp", "rejected_ref_logp")


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
    """Every prompt record of the JSONL file(s) at ``url`` (a path, an fsspec URL or a glob), in file order.

    Raises:
        RecordError: a line is not a JSON object, a key is unknown or a value has the wrong type.
        FileNotFoundError: nothing matches ``url``.
    """
    return [_prompt_record(obj, where) for obj, where in _jsonl(url)]


def read_pairs(url: str) -> list[PreferencePair]:
    """Every preference pair of the JSONL file(s) at ``url``; errors as ``read_prompts``."""
    return [_pair_record(obj, where) for obj, where in _jsonl(url)]


def shard_records(records: list[Any], rank: int, replicas: int) -> list[Any]:
    """Record i goes to rank ``i % replicas``: disjoint shards that each mix a file sorted by task."""
    if len(records) < replicas:
        raise ValueError(f"{len(records)} records cannot be sharded over {replicas} replicas (each needs 1)")
    return records[rank::replicas]


def _jsonl(url: str) -> Iterator[tuple[dict[str, Any], str]]:
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    files = fsspec.open_files(url, mode="rt", encoding="utf-8")
    if not files:
        raise FileNotFoundError(f"no file matches {url}")
    count = 0
    for file in files:
        # Local files by their path, remote ones by their URL (s3://bucket/key), as the user wrote them.
        name = file.path if isinstance(file.fs, LocalFileSystem) else file.fs.unstrip_protocol(file.path)
        with file as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{name}:{number}"
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise RecordError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
                if not isinstance(obj, dict):
                    raise RecordError(f"{where}: expected a JSON object, got {type(obj).__name__}")
                count += 1
                yield obj, where
    if not count:
        raise RecordError(f"{url}: no records")


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
