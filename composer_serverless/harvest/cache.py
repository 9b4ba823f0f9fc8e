"""The answer cache: content-addressed objects in a store, so a harvest run again over the same states and
teachers sends no request and costs nothing.

An answer is kept under the SHA-256 of the teacher's identity (base URL and model) and the exact request body
sent, so any change to what a teacher is asked (prompt, template, system message, max_tokens, temperature)
asks again, while a renamed teacher or a new price does not. Only answers are kept, never failures, and never
a header: the key is not in the body, so it cannot be in the cache. Entries are JSON, read and validated like
anything else from a store; one that is unreadable is a miss.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from composer_serverless.config import TeacherConfig
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import ObjectStore

logger = logging.getLogger(__name__)


def cache_key(teacher: TeacherConfig, body: bytes) -> str:
    """The SHA-256 (hex) of the teacher's identity (base URL and model) and the request body."""
    base_url, model = teacher.identity
    identity = json.dumps({"base_url": base_url, "model": model}, sort_keys=True)
    return hashlib.sha256(identity.encode() + b"\n" + body).hexdigest()


@dataclass(frozen=True)
class CachedAnswer:
    """An answer as it was received: its text (None: the teacher gave none, e.g. a refusal), the tokens its
    usage reported, what it cost then and how long it took."""

    content: str | None
    usage: tuple[int, int] | None
    usd: float
    latency_s: float
    model: str | None = None
    finish_reason: str | None = None

    def to_json(self, teacher: TeacherConfig, body: bytes) -> bytes:
        return json.dumps(
            {
                "base_url": teacher.base_url,
                "model": teacher.model,
                "request": json.loads(body),
                "content": self.content,
                "usage": None if self.usage is None else list(self.usage),
                "usd": self.usd,
                "latency_s": self.latency_s,
                "served_by": self.model,
                "finish_reason": self.finish_reason,
                "time": time.time(),
            },
            sort_keys=True,
            ensure_ascii=False,
        ).encode()

    @staticmethod
    def from_json(data: bytes) -> CachedAnswer:
        """Raises ValueError (or KeyError, TypeError) for anything that is not an entry."""
        obj: Any = json.loads(data)
        content, usage = obj["content"], obj["usage"]
        if content is not None and not isinstance(content, str):
            raise ValueError("content is not text")
        if usage is not None and not (
            isinstance(usage, list) and len(usage) == 2 and all(isinstance(t, int) and t >= 0 for t in usage)
        ):
            raise ValueError("usage is not two token counts")
        usd, latency = float(obj["usd"]), float(obj["latency_s"])
        if not (usd >= 0 and latency >= 0):
            raise ValueError("negative cost or latency")
        return CachedAnswer(
            content,
            None if usage is None else (usage[0], usage[1]),
            usd,
            latency,
            obj.get("served_by"),
            obj.get("finish_reason"),
        )


class AnswerCache:
    """Answers in ``store`` (its root is the cache's), read and written off the event loop: a store call
    blocks (a disk, an S3 request) and the harvest must keep its requests going meanwhile."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    def get(self, digest: str) -> CachedAnswer | None:
        try:
            data = self.store.get(layout.cache_entry(digest))
        except FileNotFoundError:
            return None
        try:
            return CachedAnswer.from_json(data)
        except (ValueError, KeyError, TypeError) as e:
            logger.warning("ignoring the unreadable cache entry %s (%s: %s)", digest, type(e).__name__, e)
            return None

    async def aget(self, digest: str) -> CachedAnswer | None:
        return await asyncio.to_thread(self.get, digest)

    async def aput(self, digest: str, answer: CachedAnswer, teacher: TeacherConfig, body: bytes) -> None:
        await asyncio.to_thread(self.store.put, layout.cache_entry(digest), answer.to_json(teacher, body))
