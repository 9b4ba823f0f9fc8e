"""Combining a token-indexed matrix's rows over the replicas that trained each one: the embedding's row bits.

Why: a replica's batch holds a few hundred of a vocabulary's tokens, so between two syncs most rows of the
embedding (and of an untied output head) are trained by one replica or by none. AdamW gives such a row a
full-size step in the replica that saw the token, and a full-size step of noise (the softmax's small push on
an absent token, normalised) in each one that did not; the plain average then keeps about 1/N of the real
step. Data-parallel training sums the gradients first, so the token's signal wins and its row takes a full
step. On the demo that difference was the whole gap between DiLoCo and data-parallel (``docs/RESULTS.md``,
section 1).

So with a ``RowMask`` an input payload carries, besides the values of its shard, a bit per step bucket of the
window for each row of each token-indexed block that overlaps the shard (``spans``): whether this replica's
inputs held that token in those steps. The shard's owner sums the values of every input as before, and for
each such row also the values of the inputs that touched it, the buckets they touched it in (summed) and the
buckets any of them did (their union). A touched row's update is its rate per bucket over those inputs times
the buckets in the union (``RowSums.apply``): data-parallel AdamW takes a step on the row at every step the
token is anywhere in the union batch, and each replica moved it over its own such steps. A token every replica
held at every step gets the plain mean; one that two replicas held at different steps, the sum of their
updates; one that a single replica held, that replica's update. A row no replica's data held keeps the plain
average, the same on every replica. Everything else in the tensor is averaged as before. Packed, the bits
are ``V x buckets / 8`` bytes per replica and block per sync (1.2 MB for a 151,936-token vocabulary at 64
buckets, against the 2 GB of its fp32 pseudo-gradient), and they travel deflated (``deflate``). A row's
buckets lie side by side, so the rows a replica's data did not hold are runs of zero bytes. zlib's fastest
level writes 2.3-2.5 times fewer bytes than the packed bits on the demo's data and 4.4 times fewer on a
151,936-token vocabulary with Zipf-like token counts (11 ms a replica for its 1.2 MB; level 9 saved another 25 %
and took 2.5 s). That matters beside the sparse codec's small payloads: at H = 50 the packed bits were half of
one.

All of it is pure and deterministic: every reducer sums the same inputs in the same order, so the average is
the same bytes whoever computes it.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import torch

# At most this many step buckets per window: a row's bits are ``min(window, MAX_BUCKETS)`` (8 bytes at most).
MAX_BUCKETS = 64


def bucket_count(window: int) -> int:
    """Step buckets of a window of ``window`` inner steps: one per step, up to ``MAX_BUCKETS`` (the replica
    that marks them and the reducer, or decoupled syncer, that reads them must agree)."""
    return max(1, min(window, MAX_BUCKETS))


@dataclass(frozen=True)
class RowBlock:
    """A ``rows`` x ``width`` row-major matrix at ``offset`` of the flat tensor, whose row i belongs to token
    ``first_token + i`` (an FSDP rank holds a slice of the rows: ``first_token`` is its first row's token)."""

    offset: int
    rows: int
    width: int
    first_token: int = 0

    def __post_init__(self) -> None:
        if self.offset < 0 or self.rows < 0 or self.width < 1 or self.first_token < 0:
            raise ValueError(f"not a row block: {self}")

    @property
    def end(self) -> int:
        return self.offset + self.rows * self.width


@dataclass(frozen=True)
class Span:
    """The rows ``[row, row + count)`` of a block that overlap a shard, and where in the shard they start:
    ``start`` (may be negative when the first row begins before the shard) and the block's row ``width``."""

    block: int
    row: int
    count: int
    start: int
    width: int


@dataclass(frozen=True)
class RowMask:
    """Which token-indexed blocks a flat tensor holds, and in which of the window's step buckets this replica's
    data held each token: ``touched`` is a bool tensor of (vocabulary, buckets), the same for every block."""

    blocks: tuple[RowBlock, ...]
    touched: torch.Tensor

    def __post_init__(self) -> None:
        if self.touched.dtype != torch.bool or self.touched.dim() != 2 or self.touched.shape[1] < 1:
            raise ValueError(
                f"touched must be a (tokens, buckets) bool tensor, got {self.touched.dtype} "
                f"{tuple(self.touched.shape)}"
            )
        for block in self.blocks:
            if block.first_token + block.rows > self.touched.shape[0]:
                raise ValueError(
                    f"{block} reaches token {block.first_token + block.rows}, past the {self.touched.shape[0]} "
                    "tokens of the mask"
                )

    @property
    def buckets(self) -> int:
        return self.touched.shape[1]

    def bits(self, spans: list[Span]) -> torch.Tensor:
        """This replica's bits for ``spans``: each row's buckets in turn, rows in span order (flat bool)."""
        if not spans:
            return torch.zeros(0, dtype=torch.bool)
        parts = []
        for span in spans:
            first = self.blocks[span.block].first_token + span.row
            parts.append(self.touched[first : first + span.count].reshape(-1))
        return torch.cat(parts)


def spans(blocks: tuple[RowBlock, ...], start: int, end: int) -> list[Span]:
    """The rows of ``blocks`` that overlap the shard ``[start, end)`` of the flat tensor, block by block."""
    out = []
    for i, block in enumerate(blocks):
        lo, hi = max(start, block.offset), min(end, block.end)
        if lo >= hi:
            continue
        first = (lo - block.offset) // block.width
        last = (hi - 1 - block.offset) // block.width  # inclusive
        out.append(Span(i, first, last - first + 1, block.offset + first * block.width - start, block.width))
    return out


def span_rows(shard_spans: list[Span]) -> int:
    """How many rows of token-indexed blocks a shard with these spans overlaps (its inputs carry a bit per row
    and step bucket)."""
    return sum(s.count for s in shard_spans)


def pack(bits: torch.Tensor) -> torch.Tensor:
    """Bits as bytes, eight to a byte, first bit in the lowest: ``ceil(n / 8)`` uint8s."""
    return torch.from_numpy(np.packbits(bits.numpy(), bitorder="little"))


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """``pack``'s inverse: the first ``n`` bits, as a bool tensor."""
    return torch.from_numpy(np.unpackbits(packed.numpy(), count=n, bitorder="little")).bool()


def deflate(bits: torch.Tensor) -> torch.Tensor:
    """The bits packed (``pack``), then zlib-deflated at its fastest level: the bytes a payload carries."""
    return torch.frombuffer(bytearray(zlib.compress(pack(bits).numpy().tobytes(), 1)), dtype=torch.uint8)


def deflated_bound(n: int) -> int:
    """The most bytes ``deflate`` writes for ``n`` bits: zlib's own bound (``compressBound``) for the packed
    size, which incompressible bits reach."""
    size = -(-n // 8)
    return size + (size >> 12) + (size >> 14) + (size >> 25) + 13


def inflate(data: bytes | memoryview, n: int) -> torch.Tensor:
    """``deflate``'s inverse: the ``n`` bits, as a bool tensor. Raises ValueError unless ``data`` is one whole
    zlib stream of exactly the packed size of ``n`` bits; it never inflates more than that (a payload cannot
    make its reader allocate more than the bits it expects)."""
    size = -(-n // 8)
    stream = zlib.decompressobj()
    try:
        packed = stream.decompress(data, size)
    except zlib.error as e:
        raise ValueError(f"row bits do not inflate: {e}") from e
    if len(packed) != size or not stream.eof or stream.unconsumed_tail or stream.unused_data:
        raise ValueError(f"row bits are not one zlib stream of {size} bytes ({n} bits)")
    return unpack(torch.frombuffer(bytearray(packed), dtype=torch.uint8), n)


class RowSums:
    """A reducer's sums for one shard's rows: per row, the values of the inputs that touched it, how many step
    buckets each touched it in, and in which buckets any did.

    ``add`` each input's values and bits in the order the shard's plain sum adds them; ``apply`` then replaces
    the plain average in the rows any input touched."""

    def __init__(self, shard_spans: list[Span], numel: int, buckets: int) -> None:
        self.rows = span_rows(shard_spans)
        self.buckets = buckets
        # The shard's elements that lie in a row, and each one's row among the span rows.
        index, row_of = [], []
        base = 0
        for span in shard_spans:
            positions = torch.arange(span.count * span.width, dtype=torch.int64) + span.start
            keep = (positions >= 0) & (positions < numel)
            index.append(positions[keep])
            row_of.append(
                base + torch.arange(span.count, dtype=torch.int64).repeat_interleave(span.width)[keep]
            )
            base += span.count
        self.index = torch.cat(index) if index else torch.zeros(0, dtype=torch.int64)
        self.row_of = torch.cat(row_of) if row_of else torch.zeros(0, dtype=torch.int64)
        self.sums = torch.zeros(self.index.numel(), dtype=torch.float32)
        self.steps = torch.zeros(self.rows, dtype=torch.int64)  # buckets summed over the inputs
        self.union = torch.zeros(self.rows, buckets, dtype=torch.bool)  # buckets any input touched the row in

    def add(self, values: torch.Tensor, bits: torch.Tensor) -> None:
        """Add one input: ``values`` (the shard's fp32 values) where its ``bits`` say its data held the row."""
        if bits.numel() != self.rows * self.buckets:
            raise ValueError(
                f"{bits.numel()} row bits for a shard of {self.rows} rows of {self.buckets} buckets"
            )
        per_row = bits.view(self.rows, self.buckets)
        steps = per_row.sum(dim=1)
        mine = (steps > 0)[self.row_of]
        self.sums[mine] += values[self.index[mine]]
        self.steps += steps
        self.union |= per_row

    def apply(self, average: torch.Tensor) -> None:
        """Replace ``average`` (the plain average of the shard) in every row an input touched.

        A touched row's update is its per-bucket rate over the inputs that touched it (their summed values over
        their summed buckets) times the buckets any of them touched it in: what one process training on all of
        their batches would have taken, if each bucket with the token moves the row alike. A token every input
        held in every bucket gets the plain mean; one that two replicas held in different buckets, the sum of
        their updates; with one bucket, the mean over the inputs that touched the row."""
        steps = self.steps[self.row_of]
        touched = steps > 0
        union = self.union.sum(dim=1)[self.row_of]
        average[self.index[touched]] = (
            self.sums[touched] * union[touched].to(torch.float32) / steps[touched].to(torch.float32)
        )
