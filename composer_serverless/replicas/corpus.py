"""The text corpus of the causal-LM objective, split by file into train and held-out sets.

The demo corpus is the Python standard library source of the running interpreter: real code nobody here
wrote, present on every machine that can run the project, so the demo needs no download. The split is by
file and by a hash of the file's path, so it is the same on every replica and every run, and no held-out
line is ever trained on. Nothing here needs a tensor library: the launcher checks a corpus before any
replica starts.
"""

from __future__ import annotations

import hashlib
import random
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


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


def training_text(corpus: Corpus, max_bytes: int, seed: int) -> Iterator[str]:
    """Train-split files in a seeded order until ``max_bytes`` of text, for fitting a tokenizer."""
    total = 0
    for rel in shuffled(corpus.train, seed):
        text = corpus.read(rel)
        yield text
        total += len(text)
        if total >= max_bytes:
            return
