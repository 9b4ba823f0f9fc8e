"""Text data for the causal-LM objective: the demo corpus, its train/held-out split, and rank shards.

The demo corpus is the Python standard library source of the running interpreter: real code nobody here
wrote, present on every machine that can run the project, so the demo needs no download. The split is by
file and by a hash of the file's path, so it is the same on every replica and every run, and no held-out
line is ever trained on.
"""

from __future__ import annotations

import hashlib
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
        raise FileNotFoundError(f"no Python sources under {root}; the stdlib corpus needs the interpreter's sources")
    cut = int(heldout_percent * 100)
    heldout = tuple(f for f in files if _bucket(f) < cut)
    train = tuple(f for f in files if _bucket(f) >= cut)
    return Corpus(root, train, heldout)


def _bucket(rel: str) -> int:
    return int.from_bytes(hashlib.sha256(rel.encode()).digest()[:4], "big") % 10_000


def shard(files: tuple[str, ...], rank: int, replicas: int, seed: int) -> tuple[str, ...]:
    """The files replica ``rank`` trains on: a seeded shuffle dealt round-robin, so shards are disjoint and
    each mixes the corpus' directories rather than taking one package each."""
    order = list(files)
    random.Random(seed).shuffle(order)
    return tuple(order[rank::replicas])


class TokenStream:
    """Fixed-length token sequences packed from files, end-of-text between files; resumable.

    The position is (epoch, file index, token offset in that file): a few integers, so a restarted replica
    re-tokenizes one file and continues exactly where its checkpoint left it.
    """

    def __init__(
        self, corpus: Corpus, files: tuple[str, ...], tokenizer: Any, seq_len: int, *, seed: int, shuffle: bool = True
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
        self._epoch, self._index, self._offset = int(state["epoch"]), int(state["index"]), int(state["offset"])
        self._order = self._epoch_order()
        self._load_file()


class Batches:
    """Batches whose rows come from ``batch_size`` independent streams over disjoint files.

    Packing consecutive sequences of one file into a batch would make its gradient as noisy as one file;
    dealing the files out to one stream per row keeps every batch a mix of ``batch_size`` files.
    """

    def __init__(
        self, corpus: Corpus, files: tuple[str, ...], tokenizer: Any, seq_len: int, batch_size: int, *, seed: int
    ) -> None:
        if len(files) < batch_size:
            raise ValueError(f"{len(files)} files cannot feed {batch_size} rows per batch; lower data.batch_size")
        self._streams = [
            TokenStream(corpus, files[row::batch_size], tokenizer, seq_len, seed=seed * 7919 + row)
            for row in range(batch_size)
        ]

    def next(self) -> torch.Tensor:
        """The next ``(batch_size, seq_len)`` batch of token ids."""
        return torch.tensor([s.next_sequence() for s in self._streams], dtype=torch.long)

    def state_dict(self) -> dict[str, Any]:
        return {"streams": [s.state_dict() for s in self._streams]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for stream, stream_state in zip(self._streams, state["streams"], strict=True):
            stream.load_state_dict(stream_state)


def training_text(corpus: Corpus, max_bytes: int, seed: int) -> Iterator[str]:
    """Train-split files in a seeded order until ``max_bytes`` of text, for fitting a tokenizer."""
    total = 0
    for rel in shard(corpus.train, 0, 1, seed):
        text = corpus.read(rel)
        yield text
        total += len(text)
        if total >= max_bytes:
            return
