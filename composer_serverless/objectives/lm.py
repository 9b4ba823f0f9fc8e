"""The causal-LM objective: cross-entropy on this replica's rows of the global batch (the trained tokens only:
a chat record's assistant turns), evaluated the same way on the held-out documents."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from composer_serverless.config import RunConfig
from composer_serverless.data.corpus import documents, shuffled
from composer_serverless.data.packing import IGNORE, Batches
from composer_serverless.objectives.shares import EvalPart, share

# Held-out sequences are drawn from this many interleaved file streams, independent of the training batch size.
EVAL_STREAMS = 8


class Ranks(Protocol):
    """The ranks of one replica as an objective sees them (the replica loop's ``Node``): which slice of a
    batch is this rank's, and sums over the ranks (a collective: every rank calls it)."""

    local_rank: int
    size: int

    def sum(self, values: list[float]) -> list[float]: ...


class LMObjective:
    """Causal-LM cross-entropy on this replica's rows of the global batch (on the trained tokens only: a chat
    record's assistant turns); evaluation on the held-out documents, the same way.

    In a replica of G ranks, local rank l takes the l-th of G equal slices of the replica's rows, and its loss
    is its tokens' summed loss over the replica's mean tokens per rank: FSDP averages the ranks' gradients, so
    the step is that of the mean over every trained token of the replica's batch, as with one rank, whatever
    share of the trained tokens each slice holds."""

    def __init__(self, config: RunConfig, tokenizer: Any, rank: int, node: Ranks | None = None) -> None:
        corpus = documents(config.data)
        seq_len, batch_size = config.data.seq_len, config.data.batch_size
        self._train = Batches(
            corpus,
            shuffled(corpus.train, config.seed),
            tokenizer,
            seq_len,
            batch_size,
            seed=config.seed,
            streams_per_row=config.data.streams_per_row,
            replicas=config.diloco.replicas,
            rank=rank,
        )
        # Fixed seed and stream count: every replica, and any run with another batch size, scores the same
        # held-out sequences (fewer streams only when there are fewer held-out documents).
        self._eval_streams = min(EVAL_STREAMS, len(corpus.heldout))
        self._heldout = Batches(corpus, corpus.heldout, tokenizer, seq_len, self._eval_streams, seed=0)
        self._eval_sequences = config.eval.sequences
        self._batch_size = batch_size
        self._micro_batch_size = config.train.micro_batch_size
        self._node = node
        self._eval_set: tuple[torch.Tensor, torch.Tensor] | None = None

    def losses(self, model: torch.nn.Module) -> Iterator[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        """This rank's rows in micro-batches of ``train.micro_batch_size`` rows, each loss a sum over its
        trained tokens divided by the step's count of them (per rank, as FSDP averages the ranks): their
        gradients add up to the whole batch's mean. One micro-batch takes the model's own mean."""
        device = _device_of(model)
        node = self._node
        local_rank, size = (0, 1) if node is None else (node.local_rank, node.size)
        rows = self._batch_size // size
        ids, labels = (t[local_rank * rows : (local_rank + 1) * rows].to(device) for t in self._train.next())
        step = min(rows, self._micro_batch_size or rows)
        trained = _targets(labels) if size == 1 else int(node.sum([_targets(labels)])[0])  # type: ignore[union-attr]
        # The model's own mean, when it is the step's: one micro-batch on one rank.
        count = None if step == rows and size == 1 else max(1, trained) / size
        # The replica's trained tokens come with the first micro-batch (the step's metrics are the parts' sums).
        tokens = {"lm/tokens": float(trained)}
        for start in range(0, rows, step):  # the same number of passes on every rank: FSDP's collectives
            part_ids, part_labels = ids[start : start + step], labels[start : start + step]
            out = model(input_ids=part_ids, labels=part_labels, use_cache=False, num_items_in_batch=count)
            if not trained:  # every token of the batch is masked: nothing to learn, and no NaN either
                yield out.logits.sum() * 0.0, tokens
            else:
                yield out.loss, {"lm/loss": out.loss.detach(), **tokens}
            tokens = {}

    @torch.no_grad()
    def evaluate_part(self, model: torch.nn.Module, part: int, parts: int) -> EvalPart:
        if self._eval_set is None:
            batches = [self._heldout.next() for _ in range(-(-self._eval_sequences // self._eval_streams))]
            ids, labels = (torch.cat(column)[: self._eval_sequences] for column in zip(*batches, strict=True))
            self._eval_set = ids, labels
        rows = share(list(range(len(self._eval_set[0]))), part, parts)
        if not rows:
            return {}
        was_training = model.training
        model.eval()
        device = _device_of(model)
        # The model's loss is a mean over a batch's trained tokens; weighted by their count, the shares add up
        # to the mean over every held-out token.
        total, tokens = 0.0, 0
        for index in torch.tensor(rows).split(self._batch_size):
            ids, labels = (t[index].to(device) for t in self._eval_set)
            if count := _targets(labels):
                out = model(input_ids=ids, labels=labels, use_cache=False)
                total += out.loss.float().item() * count
                tokens += count
        model.train(was_training)
        return {"eval/loss": (total, tokens)} if tokens else {}

    def state_dict(self) -> dict[str, Any]:
        return {"train": self._train.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._train.load_state_dict(state["train"])

    def round_ended(
        self,
        round_index: int,
        global_model: Callable[[], contextlib.AbstractContextManager[torch.nn.Module]],
        waiting: Callable[[str], None],
    ) -> dict[str, Any]:
        return {}


def _targets(labels: torch.Tensor) -> int:
    """How many tokens of a batch are predicted and trained on (a row's first token is never predicted)."""
    return int((labels[:, 1:] != IGNORE).sum())


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device
