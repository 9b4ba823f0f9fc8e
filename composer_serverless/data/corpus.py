"""The documents of the causal-LM objective, split into train and held-out sets: the offline demo corpus, or
the user's text or chat records.

The demo corpus is the Python standard library source of the running interpreter: real code nobody here
wrote, present on every machine that can run the project, so the demo needs no download. A document is one
of its files, or one record of the user's files. Unless the held-out records are given, the split is by a
hash of where each document is (its path, or ``file:line``), so it is the same on every replica and every
run, and no held-out document is ever trained on. Nothing here needs a tensor library: the launcher checks a
corpus before any replica starts.
"""

from __future__ import annotations

import hashlib
import random
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from composer_serverless.config import DataConfig
from composer_serverless.data.chat import render_chat
from composer_serverless.data.records import RecordError, read_rows

# A document's token ids, and per token whether it is trained on (the loss mask).
Tokens = tuple[list[int], list[bool]]
# The column of a chat record that holds the tools its conversation may call (TRL's SFT datasets' name).
TOOLS_FIELD = "tools"


@dataclass(frozen=True)
class Conversation:
    """A chat record: its messages, and the schemas of the tools they may call (rendered into the prompt by
    the chat template, as the episodes' prompts are), or None."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None


class Documents(Protocol):
    """Documents by id, split into train and held-out ids; each tokenizes to ids and a loss mask."""

    @property
    def train(self) -> tuple[str, ...]: ...

    @property
    def heldout(self) -> tuple[str, ...]: ...

    def tokens(self, doc: str, tokenizer: Any) -> Tokens: ...


@dataclass(frozen=True)
class Corpus:
    """Files of a text corpus under ``root``, split into train and held-out sets (paths relative to root)."""

    root: Path
    train: tuple[str, ...]
    heldout: tuple[str, ...]

    def read(self, rel: str) -> str:
        return (self.root / rel).read_text(encoding="utf-8", errors="replace")

    def tokens(self, doc: str, tokenizer: Any) -> Tokens:
        return _text_tokens(self.read(doc), tokenizer)


@dataclass(frozen=True)
class RecordCorpus:
    """The user's records by ``file:line``: a text each, or a ``Conversation`` each (``chat``)."""

    values: dict[str, Any]
    train: tuple[str, ...]
    heldout: tuple[str, ...]
    chat: bool

    def tokens(self, doc: str, tokenizer: Any) -> Tokens:
        if not self.chat:
            return _text_tokens(self.values[doc], tokenizer)
        conversation = self.values[doc]
        ids, mask = render_chat(tokenizer, conversation.messages, conversation.tools)
        if not ids or ids[-1] != tokenizer.eos_token_id:  # a separator from the next document, not learned
            ids, mask = [*ids, tokenizer.eos_token_id], [*mask, False]
        return ids, mask


def documents(data: DataConfig) -> Documents:
    """The documents ``data`` names, read once (records are held in memory)."""
    if data.is_stdlib:
        return stdlib_corpus(data.heldout_percent)
    field = data.messages_field if data.format == "chat" else data.text_field
    values = _record_values(data.corpus, field, chat=data.format == "chat")
    if data.heldout is not None:
        heldout_values = _record_values(data.heldout, field, chat=data.format == "chat")
        return RecordCorpus(
            {**values, **heldout_values}, tuple(values), tuple(heldout_values), data.format == "chat"
        )
    cut = int(data.heldout_percent * 100)
    heldout = tuple(doc for doc in values if _bucket(doc) < cut)
    train = tuple(doc for doc in values if _bucket(doc) >= cut)
    return RecordCorpus(values, train, heldout, data.format == "chat")


def _record_values(url: str, field: str, *, chat: bool) -> dict[str, Any]:
    """``field`` of every record at ``url`` by ``file:line``, checked to be a text or a conversation.

    Raises:
        RecordError: a record lacks the field or holds the wrong kind of value.
    """
    values = {}
    for row, where in read_rows(url):
        value = row.get(field)
        if chat:
            turns_ok = (
                isinstance(value, list)
                and value
                and all(
                    isinstance(t, dict)
                    and isinstance(t.get("role"), str)
                    and isinstance(t.get("content"), str)
                    for t in value
                )
            )
            if not turns_ok or not any(t["role"] == "assistant" for t in value):
                raise RecordError(
                    f"{where}: {field!r} must be a list of {{role, content}} messages with an assistant turn "
                    f"(got {type(value).__name__})"
                )
            tools = row.get(TOOLS_FIELD)
            if tools is not None and not (
                isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
            ):
                raise RecordError(
                    f"{where}: {TOOLS_FIELD!r} must be a list of JSON-schema objects, one per tool, as "
                    f"TRL's tool-calling datasets hold them (got {type(tools).__name__})"
                )
            value = Conversation(value, tools)
        elif not isinstance(value, str) or not value:
            raise RecordError(f"{where}: {field!r} must be a non-empty string (got {type(value).__name__})")
        values[where] = value
    return values


def _text_tokens(text: str, tokenizer: Any) -> Tokens:
    ids = [*tokenizer(text)["input_ids"], tokenizer.eos_token_id]
    return ids, [True] * len(ids)


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
