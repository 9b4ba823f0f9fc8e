"""What an inner step optimises. The trainer knows only this protocol; each objective owns its data.

An objective draws its own next batch because objectives differ in what a batch is: the causal-LM objective
packs text, the composer objective samples completions from the current model and scores them. The trainer
only backpropagates what ``losses`` yields and checkpoints what ``state_dict`` returns.

A step's batch comes as micro-batches (``train.micro_batch_size``), each backpropagated before the next is
drawn, so activation memory follows the micro-batch; each is normalised by the whole step's counts, so their
gradients add up to the whole batch's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol, runtime_checkable

import torch

from composer_serverless.config import RunConfig
from composer_serverless.objectives.composer import ComposerObjective
from composer_serverless.objectives.lm import LMObjective, Ranks
from composer_serverless.objectives.shares import EvalPart, combine
from composer_serverless.rendezvous.store import ObjectStore

Metrics = dict[str, torch.Tensor | float]


@runtime_checkable
class Objective(Protocol):
    def losses(self, model: torch.nn.Module) -> Iterator[tuple[torch.Tensor, Metrics]]:
        """Draw the next batch and yield, per micro-batch, its part of the step's scalar loss (to backpropagate
        before the next is drawn) and its parts of the step's namespaced scalar metrics (floats or 0-dim
        tensors): the step's loss and metrics are the sums of the parts. The trainer records each metric's
        mean over a round's steps."""
        ...

    def evaluate_part(self, model: torch.nn.Module, part: int, parts: int) -> EvalPart:
        """Score ``model`` on share ``part`` of ``parts`` of the held-out data (``shares.share``): per
        metric, namespaced (``eval/loss``), the sum and the count that ``shares.combine`` averages."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The data position, JSON-serialisable, so a restarted replica continues where it stopped."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def round_ended(
        self,
        round_index: int,
        global_model: Callable[[], contextlib.AbstractContextManager[torch.nn.Module]],
        waiting: Callable[[str], None],
    ) -> dict[str, Any]:
        """Called once per committed round, before its metrics row is written: whatever the objective does
        between rounds (the composer objective records its rollouts and takes harvested pairs, waiting for
        them if they are late). Entering ``global_model()`` swaps the round's global parameters into the
        model; ``waiting(what)`` puts what the replica waits for in its heartbeat. Returns fields for the
        row."""
        ...


def add_parts(total: Metrics, part: Metrics) -> Metrics:
    """``total`` with a micro-batch's metric parts added."""
    return {**total, **{name: total.get(name, 0.0) + value for name, value in part.items()}}


def step_loss(objective: Objective, model: torch.nn.Module) -> tuple[torch.Tensor, Metrics]:
    """The next step's whole loss in one graph, and its metrics: for a test or a benchmark that wants the loss
    rather than the step (it holds every micro-batch's activations at once)."""
    loss: torch.Tensor | None = None
    metrics: Metrics = {}
    for part, part_metrics in objective.losses(model):
        loss = part if loss is None else loss + part
        metrics = add_parts(metrics, part_metrics)
    assert loss is not None, "an objective yields at least one micro-batch"
    return loss, metrics


def evaluate(objective: Objective, model: torch.nn.Module) -> dict[str, float]:
    """Score ``model`` on the whole held-out set, on this process alone."""
    return combine([objective.evaluate_part(model, 0, 1)])


def make_objective(
    config: RunConfig,
    tokenizer: Any,
    rank: int,
    *,
    model: torch.nn.Module,
    adapters: Any = None,
    node: Ranks | None = None,
    run: ObjectStore | None = None,
) -> Objective:
    """The objective ``config.train.objective`` names.

    ``model`` must still hold the run's initial weights: objectives with a frozen reference (DPO, a KL term)
    take it from the model they are built with (with LoRA, the base model with ``adapters`` off). ``run`` is
    the run's store, for what an objective keeps there between rounds (recorded rollouts, harvested pairs).
    ``node``: the replica's ranks (None: one).
    """
    if config.train.objective == "composer":
        return ComposerObjective(config, model, tokenizer, rank, adapters, run, node)
    return LMObjective(config, tokenizer, rank, node)
