"""The weights a replica trains: loading them, checking that every replica starts from the same ones, their
digest, and swapping the global parameters in (to evaluate or save the global model).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from composer_serverless.config import RunConfig
from composer_serverless.models.loading import Loaded, load_model
from composer_serverless.rendezvous import checkpoint, layout
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.replicas.node import SOLO, Node
from composer_serverless.replicas.shards import local


class InitialWeightsError(RuntimeError):
    """This replica loaded weights that differ from another replica's, so the run cannot be DiLoCo."""


def load_run_model(run: ObjectStore, config: RunConfig, cache: Path) -> Loaded:
    """Load the run's model as it trains, from ``model_source``."""
    return load_model(config.model, model_source(run, config, cache / layout.MODEL))


def model_source(run: ObjectStore, config: RunConfig, into: Path) -> str | Path:
    """What ``from_pretrained`` loads the run's model from: ``model.path`` (a Hub id, or a directory this
    process reads), or the run's ``model/`` as a local directory (downloaded into ``into`` from a remote
    store): the tiny model the launcher built, or a model directory it shipped for cloud replicas (run.json's
    ``model.path`` then names that prefix)."""
    path = config.model.path
    if path is not None and not run.child(layout.MODEL).is_at(path):
        return path
    return run.local_dir(layout.MODEL) or run.download_dir(layout.MODEL, into)


def digest(params: dict[str, torch.Tensor], node: Node = SOLO) -> str:
    """sha256 over the raw bytes of every tensor in name order: equal iff bit-identical. In a replica of
    several ranks, over each rank's shards, combined (a collective: every rank calls it)."""
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode())
        h.update(local(params[name]).detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return node.combine_digests(h.hexdigest())


def check_initial_weights(run: ObjectStore, model: nn.Module, rank: int, node: Node = SOLO) -> None:
    """Refuse to train from weights that differ from the other replicas'.

    DiLoCo averages pseudo-gradients, not parameters: replicas that start apart stay apart for the whole
    run. The first fresh replica records the digest of its weights (create-if-absent); every other one must
    match it. In a replica of several ranks the lead compares, and every rank stops if it must.

    Raises:
        InitialWeightsError: this replica's weights are not the recorded ones.
    """
    mine = digest(dict(model.named_parameters()), node)
    if node.all_true(not node.lead or checkpoint.agree_on_initial_weights(run, mine)):
        return
    raise InitialWeightsError(
        f"replica {rank}: the model's initial weights differ from those another replica loaded "
        f"(sha256 {mine[:12]} vs {checkpoint.initial_weights(run)[:12]}); DiLoCo needs every replica to start "
        "from the same weights. Load them deterministically: a model whose code initialises weights at load "
        "time with its own randomness, or a checkpoint that changed while replicas downloaded it, does this"
    )


@contextmanager
def swapped_in(model: nn.Module, params: dict[str, torch.Tensor]) -> Iterator[nn.Module]:
    """Temporarily load ``params`` into ``model`` (to evaluate or save the global model), then restore. In a
    sharded model, ``params`` are this rank's shards (as DiLoCo keeps them)."""
    current = {name: local(p) for name, p in model.named_parameters()}
    saved = {name: current[name].detach().clone() for name in params}
    with torch.no_grad():
        for name, value in params.items():
            current[name].copy_(value)
    try:
        yield model
    finally:
        with torch.no_grad():
            for name, value in saved.items():
                current[name].copy_(value)
