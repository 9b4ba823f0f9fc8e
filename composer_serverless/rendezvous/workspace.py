"""Buffers an exchange reads payloads into and sums shards in, kept between syncs."""

from __future__ import annotations

import threading

import torch


class Workspace:
    """The buffers an exchange reads payloads into and sums shards in, kept by the caller between syncs.

    Fresh buffers of a model's size are fresh pages every sync (the allocator hands big blocks back to the
    OS), and on a box where replicas share cores faulting them in was about a tenth of an exchange's CPU.
    One exchange at a time may use a workspace; a second one at the same time is refused. Within it, the
    exchange's transfer threads may each ask for a slot of their own.
    """

    def __init__(self) -> None:
        self._buffers: dict[object, torch.Tensor] = {}
        self.busy = threading.Lock()
        self._slots = threading.Lock()

    def bytes(self, slot: object, size: int) -> memoryview:
        """A writable buffer of ``size`` bytes for ``slot``, grown if too small, not zero-filled."""
        with self._slots:
            buffer = self._buffers.get(slot)
            if buffer is None or buffer.numel() < size:
                buffer = self._buffers[slot] = torch.empty(size, dtype=torch.uint8)
        return memoryview(buffer.numpy()).cast("B")[:size]

    def floats(self, slot: object, numel: int) -> torch.Tensor:
        """An fp32 tensor of ``numel`` values for ``slot``, not zero-filled."""
        if numel == 0:
            return torch.empty(0)
        return torch.frombuffer(self.bytes(slot, 4 * numel), dtype=torch.float32)
