"""The ranks of one replica: G processes that shard the model with FSDP2 and act as one replica towards the
store.

Inside a replica the ranks train as one data-parallel model (each holds 1/G of every parameter and takes 1/G
of the replica's batch); across replicas each local rank exchanges only its own shard (``layout`` keys carry
the local rank). Everything the replica decides from the store (which round to load, whether it is behind,
whether a sync committed) must be decided once, or the ranks would drift apart and deadlock in FSDP's next
collective: the lead (local rank 0) reads the store and ``broadcast`` s the answer, and a sync commits only if
it committed on every rank (``all_true``), as torchft's Manager does for a replica group.

These collectives run on a gloo group of their own (CPU tensors, whatever backend FSDP uses), always from the
main thread and in the same order on every rank. A replica of one rank uses ``SOLO``, where all of them are
the identity, so the single-process path runs no collective at all.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# A sha256 digest, as the bytes all_gather moves.
_DIGEST_BYTES = 32


@dataclass(frozen=True)
class Node:
    """Local rank ``local_rank`` of the ``size`` ranks of one replica, and the group they agree over."""

    local_rank: int = 0
    size: int = 1
    group: Any = None

    def __post_init__(self) -> None:
        if not 0 <= self.local_rank < self.size:
            raise ValueError(f"local rank {self.local_rank} is outside [0, {self.size})")
        if self.size > 1 and self.group is None:
            raise ValueError("a node of several ranks needs a process group")

    @property
    def lead(self) -> bool:
        """The rank that reads the store for the replica and writes what the replica reports."""
        return self.local_rank == 0

    def broadcast(self, value: int) -> int:
        """The lead's ``value`` on every rank."""
        return self.broadcast_ints([value])[0]

    def broadcast_ints(self, values: list[int]) -> list[int]:
        """The lead's ``values`` on every rank (the same count on each)."""
        if self.size == 1:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.int64)
        dist.broadcast(tensor, group_src=0, group=self.group)
        return tensor.tolist()

    def all_true(self, flag: bool) -> bool:
        """True on every rank iff ``flag`` is true on every rank."""
        if self.size == 1:
            return flag
        tensor = torch.tensor([int(flag)], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        return bool(tensor.item())

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sums of ``values`` over the ranks (float64)."""
        if self.size == 1:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor, group=self.group)
        return tensor.tolist()

    def union(self, flags: torch.Tensor) -> torch.Tensor:
        """Element-wise OR of a bool CPU tensor over the ranks."""
        if self.size == 1:
            return flags
        tensor = flags.to(torch.uint8)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return tensor.bool()

    def gather(self, value: float) -> list[float]:
        """Every rank's ``value``, in local-rank order."""
        if self.size == 1:
            return [value]
        out = [torch.zeros(1, dtype=torch.float64) for _ in range(self.size)]
        dist.all_gather(out, torch.tensor([value], dtype=torch.float64), group=self.group)
        return [float(t.item()) for t in out]

    def combine_digests(self, hex_digest: str) -> str:
        """One digest for the replica from each rank's sha256 of its shards: equal across replicas iff every
        rank's shards are. With one rank, that rank's digest unchanged."""
        if self.size == 1:
            return hex_digest
        mine = torch.frombuffer(bytearray(bytes.fromhex(hex_digest)), dtype=torch.uint8)
        if mine.numel() != _DIGEST_BYTES:
            raise ValueError(f"not a sha256 digest: {hex_digest!r}")
        out = [torch.zeros(_DIGEST_BYTES, dtype=torch.uint8) for _ in range(self.size)]
        dist.all_gather(out, mine, group=self.group)
        return hashlib.sha256(b"".join(bytes(t.tolist()) for t in out)).hexdigest()

    def barrier(self) -> None:
        """Wait until every rank got here: before the lead points LATEST at a state every rank wrote."""
        if self.size > 1:
            dist.barrier(group=self.group)


SOLO = Node()


def training_seed(seed: int, rank: int, node: Node) -> int:
    """The seed of replica ``rank``'s local rank ``node.local_rank`` for training: one per (replica, local rank)
    of the run, so no two ranks draw the same random stream (a replica's G ranks sample their rollouts and
    dropout apart, as replicas do), and the same on every run of the same config. ``seed + rank`` with one rank
    per replica."""
    return seed + rank * node.size + node.local_rank
