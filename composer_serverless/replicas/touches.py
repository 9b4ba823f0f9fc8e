"""Which tokens a replica trained on since each fragment's last sync, and at which steps, for combining the
embedding's rows over the replicas that trained them (``rendezvous/rows.py`` says why).

A forward pre-hook on the model's input embedding marks the token ids of every forward that builds a graph
(training; generation, evaluation and reference scoring run without one and are not counted), in the bucket
of the window's steps the current step falls in (one bucket per step up to ``MAX_BUCKETS``). The marks live
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

from composer_serverless.rendezvous.rows import RowBlock, RowMask, bucket_count
from composer_serverless.replicas.node import Node
from composer_serverless.replicas.shards import local


def token_blocks(fragment: nn.Module, token_weights: list[nn.Parameter]) -> tuple[RowBlock, ...]:
    """The blocks of ``fragment``'s flat bucket (its parameters in ``named_parameters`` order, each as this
    rank holds it) that are one of ``token_weights`` (each with a row per token)."""
    wanted = {id(w) for w in token_weights}
    blocks, offset = [], 0
    for _, p in fragment.named_parameters():
        held = local(p)
        # A rank whose shard holds no row still has the block (of no rows): every rank of a replica must
        # agree on which fragments take part in the union at a sync.
        if id(p) in wanted:
            first = 0
            if isinstance(p, DTensor):
                _, global_offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                first = int(global_offset[0])
            blocks.append(RowBlock(offset=offset, rows=held.shape[0], width=held.shape[1], first_token=first))
        offset += held.numel()
    return tuple(blocks)


class Touches:
    """Per fragment with token-indexed blocks, in which step buckets of its window (the ``window`` inner steps
    between two of its syncs) this replica's training fed the model each token.

    ``advance`` must run after each inner step and before the sync that step may start (the trainer registers
    it on the inner optimizer before DiLoCo's hook): a window's steps are counted from the sync that opened it.
    """

    def __init__(self, model: nn.Module, fragments: list[nn.Module], node: Node, window: int) -> None:
        embedding = model.get_input_embeddings()
        self.vocab = embedding.weight.shape[0]
        weights = [embedding.weight]
        head = model.get_output_embeddings()
        if head is not None and getattr(head, "weight", None) is not None:
            weights.append(head.weight)
        # The weights with a row per token (an untied head of another shape has none); a frozen one (LoRA)
        # is in no fragment, so no block of it is marked.
        self.token_weights = [w for w in weights if w.dim() == 2 and w.shape[0] == self.vocab]
        self.blocks = [token_blocks(f, self.token_weights) for f in fragments]
        self.node = node
        self.window = window
        self.buckets = bucket_count(window)
        device = embedding.weight.device
        # (buckets, vocabulary): each bucket's marks contiguous, for index_fill_.
        self.marks = {
            f: torch.zeros(self.buckets, self.vocab, dtype=torch.bool, device=device)
            for f, blocks in enumerate(self.blocks)
            if blocks
        }
        self.step = 0  # inner steps this object has seen
        self.opened = dict.fromkeys(self.marks, 0)  # the step each fragment's window opened at
        if self.marks:
            embedding.register_forward_pre_hook(self._record)

    def advance(self) -> None:
        """One inner step was taken."""
        self.step += 1

    def _bucket(self, fragment: int) -> int:
        return min((self.step - self.opened[fragment]) * self.buckets // self.window, self.buckets - 1)

    def _record(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if not torch.is_grad_enabled() or not args or not isinstance(args[0], torch.Tensor):
            return
        ids = args[0].reshape(-1)
        for f, marks in self.marks.items():
            marks[self._bucket(f)].index_fill_(0, ids, True)

    def take(self, fragment: int) -> RowMask | None:
        """The row mask for ``fragment``'s sync, opening its next window; None if it has no token-indexed
        block. Every rank of the replica calls it at the same sync (it is a collective there)."""
        marks = self.marks.get(fragment)
        if marks is None:
            return None
        touched = self.node.union(marks.to("cpu", copy=True))  # a copy: the marks are zeroed next
        marks.zero_()
        self.opened[fragment] = self.step
        return RowMask(self.blocks[fragment], touched.t().contiguous())

    def clear(self) -> None:
        """Forget every mark and open every window now: the local weights were replaced (a published state
        loaded, a rollback), and the steps that marked them with it."""
        for f, marks in self.marks.items():
            marks.zero_()
            self.opened[f] = self.step

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The marks a resume must start from to be exact (a fragment that synced mid-round has marked the
        steps since), and how far into its window each fragment is."""
        state = {}
        for f, marks in self.marks.items():
            state[str(f)] = marks.to("cpu", copy=True)
            state[f"{f}/steps"] = torch.tensor(self.step - self.opened[f])
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor] | None) -> None:
        """Continue from ``state_dict``'s marks; none (an own state saved without them): a fresh window."""
        self.clear()
        for f, marks in self.marks.items():
            saved = (state or {}).get(str(f))
            if saved is not None and saved.shape == marks.shape:
                marks.copy_(saved)
                self.opened[f] = self.step - int((state or {})[f"{f}/steps"])
