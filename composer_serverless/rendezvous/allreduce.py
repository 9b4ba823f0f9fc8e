"""All-reduce of one flat fp32 tensor through the object store.

This is the simple exchange with a fixed set of participants: every replica uploads its whole tensor and
downloads everyone else's. Upload S and download (N-1)*S per replica and round; correct and deterministic,
since every replica sums the same bytes in the same (rank) order and so ends with bit-identical results.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

import torch

from composer_serverless.rendezvous.codec import decode, encode
from composer_serverless.rendezvous.store import ObjectStore

logger = logging.getLogger(__name__)


@dataclass
class ExchangeStats:
    """What one exchange cost this replica."""

    bytes_up: int = 0
    bytes_down: int = 0
    wait_s: float = 0.0


def wait_for_names(
    store: ObjectStore, prefix: str, names: set[str], timeout_s: float, *, first_s: float = 0.01, cap_s: float = 1.0
) -> None:
    """Poll fresh listings of ``prefix`` until every name in ``names`` exists.

    The delay grows geometrically with jitter, so N replicas polling the same prefix neither hammer the store
    nor fall into lock-step.

    Raises:
        TimeoutError: naming the objects still missing after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    delay = first_s
    while True:
        missing = names - set(store.list(prefix))
        if not missing:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"after {timeout_s:.0f}s still missing under {store.url_of(prefix)}: {sorted(missing)}")
        time.sleep(delay * (0.5 + random.random()))
        delay = min(cap_s, delay * 1.5)


def naive_allreduce(
    store: ObjectStore,
    prefix: str,
    tensor: torch.Tensor,
    *,
    rank: int,
    participants: list[int],
    identity: dict[str, str],
    timeout_s: float,
) -> tuple[torch.Tensor, ExchangeStats]:
    """Average ``tensor`` (flat fp32) over ``participants``; returns the average and what it cost.

    Objects: ``{prefix}/in/{rank}-0``, one per participant, written once.
    """
    stats = ExchangeStats()
    payload = encode(tensor, {**identity, "rank": str(rank), "shard": "0"}, "fp32")
    store.put(f"{prefix}/in/{rank}-0", payload)
    stats.bytes_up += len(payload)

    started = time.monotonic()
    wait_for_names(store, f"{prefix}/in", {f"{r}-0" for r in participants}, timeout_s)
    stats.wait_s = time.monotonic() - started

    total = torch.zeros(tensor.numel(), dtype=torch.float32)
    for r in sorted(participants):
        if r == rank:
            total += tensor.reshape(-1).to(torch.float32)
            continue
        data = store.get(f"{prefix}/in/{r}-0")
        stats.bytes_down += len(data)
        total += decode(data, {**identity, "rank": str(r), "shard": "0"}, "fp32", tensor.numel())
    total /= len(participants)
    return total, stats
