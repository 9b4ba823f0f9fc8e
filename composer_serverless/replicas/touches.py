"""Which tokens a replica trained on since each fragment's last sync, for averaging the embedding's rows over
the replicas that trained them (``rendezvous/rows.py`` says why).

A forward pre-hook on the model's input embedding marks the token ids of every forward that builds a graph
(training; generation, evaluation and reference scoring run without one and are not counted). The marks live
on the embedding's device and are set with ``index_fill_``, so counting adds no host-device wait to a step;
they are copied to the host once per sync. In a replica of several ranks each rank sees its own part of the
batch, so the replica's marks are the union over its ranks, and each rank sends the bits of the rows it
holds (FSDP2 shards the embedding by rows).

The token-indexed blocks of a fragment are the input embedding's weight and, when it is a parameter of its
own with a row per token, the output head's. A frozen embedding (LoRA) is in no fragment, so nothing is
counted for it and the average is the plain one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from composer_serverless.rendezvous.rows import RowBlock, RowMask
from composer_serverless.replicas.node import Node


def token_blocks(fragment: nn.Module, token_weights: list[nn.Parameter], vocab: int) -> tuple[RowBlock, ...]:
    """The blocks of ``fragment``'s flat bucket (its parameters in ``named_parameters`` order, each as this
    rank holds it) that are one of ``token_weights`` with a row per token."""
    wanted = {id(w) for w in token_weights}
    blocks, offset = [], 0
    for _, p in fragment.named_parameters():
        held = p.to_local() if isinstance(p, DTensor) else p
        if id(p) in wanted and p.dim() == 2 and p.shape[0] == vocab and held.numel():
            first = 0
            if isinstance(p, DTensor):
                _, global_offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                first = int(global_offset[0])
            blocks.append(RowBlock(offset=offset, rows=held.shape[0], width=held.shape[1], first_token=first))
        offset += held.numel()
    return tuple(blocks)


class Touches:
    """Per fragment with token-indexed blocks, the tokens this replica's training fed the model since that
    fragment last synced."""

    def __init__(self, model: nn.Module, fragments: list[nn.Module], node: Node) -> None:
        embedding = model.get_input_embeddings()
        self.vocab = embedding.weight.shape[0]
        weights = [embedding.weight]
        head = model.get_output_embeddings()
        if head is not None and getattr(head, "weight", None) is not None:
            weights.append(head.weight)
        self.blocks = [token_blocks(f, weights, self.vocab) for f in fragments]
        self.node = node
        device = embedding.weight.device
        self.marks = {
            f: torch.zeros(self.vocab, dtype=torch.bool, device=device)
            for f, blocks in enumerate(self.blocks)
            if blocks
        }
        self._hook = embedding.register_forward_pre_hook(self._record) if self.marks else None

    def _record(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if not torch.is_grad_enabled() or not args or not isinstance(args[0], torch.Tensor):
            return
        ids = args[0].reshape(-1)
        for marks in self.marks.values():
            marks.index_fill_(0, ids, True)

    def take(self, fragment: int) -> RowMask | None:
        """The row mask for ``fragment``'s sync, starting its next count; None if it has no token-indexed
        block. Every rank of the replica calls it at the same sync (it is a collective there)."""
        marks = self.marks.get(fragment)
        if marks is None:
            return None
        touched = self.node.union(marks.to("cpu", copy=True))  # a copy: the marks are zeroed next
        marks.zero_()
        return RowMask(self.blocks[fragment], touched)

    def clear(self) -> None:
        """Forget every count: the local weights were replaced (a published state loaded, a rollback)."""
        for marks in self.marks.values():
            marks.zero_()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The counts a resume must start from to be exact (a fragment that synced mid-round has counted
        the steps since)."""
        return {str(f): marks.to("cpu", copy=True) for f, marks in self.marks.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor] | None) -> None:
        self.clear()
        for f, marks in (state or {}).items():
            if int(f) in self.marks and marks.shape == self.marks[int(f)].shape:
                self.marks[int(f)].copy_(marks)

    def remove(self) -> None:
        if self._hook is not None:
            self._hook.remove()
