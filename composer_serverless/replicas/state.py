"""A replica's state in the store: the global state it publishes and loads, and its own state it saves so that
a restarted replica (or a run whose replicas all died) continues exactly where it stopped.

The global state is what DiLoCo registered with the manager (per fragment, the global parameters and the
outer optimizer state) plus the sync step. A replica's own state is its inner optimizer, learning-rate
schedule, data position, RNG, and the local parameters that ran ahead of the global ones.
"""

from __future__ import annotations

import random
from typing import Any

import torch
from torch import nn

from composer_serverless.rendezvous import checkpoint
from composer_serverless.rendezvous.checkpoint import CheckpointError
from composer_serverless.rendezvous.latest import latest_round
from composer_serverless.rendezvous.manager import ObjectStoreManager
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.replicas.diloco import global_parameters
from composer_serverless.replicas.objective import Objective


def global_state(manager: ObjectStoreManager) -> dict[str, Any]:
    return {"step": manager.current_step(), "user": manager.user_state_dict()}


def load_global(store: ObjectStore, round_index: int) -> dict[str, Any]:
    """The published state of ``round_index``, or of a newer round if that one was pruned meanwhile."""
    for _ in range(3):
        try:
            return checkpoint.load_global(store, round_index)
        except FileNotFoundError:
            round_index = latest_round(store)
    raise CheckpointError(f"cannot read the global state of round {round_index} from {store.url}")


def apply_global(
    manager: ObjectStoreManager, names: list[dict[str, str]], model: nn.Module, state: dict[str, Any]
) -> None:
    """Load a published global state into DiLoCo's fragments and the model, and move the manager's step."""
    user = state["user"]
    for i, mapping in enumerate(names):
        saved = set(user.get(f"StreamingDiLoCoFragment_{i}", {}).get("original_parameters", {}))
        if saved != set(mapping):
            raise CheckpointError(
                f"fragment {i} of the published state does not match this model's parameters"
            )
    manager.load_user_state_dict(user)
    manager.set_step(int(state["step"]))
    params = global_parameters(manager, names)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in params:  # frozen weights are not part of the global state
                p.copy_(params[name])


def own_state(
    model: nn.Module,
    inner: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler,
    objective: Objective,
    global_params: dict[str, torch.Tensor],
) -> dict[str, Any]:
    rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return {
        "inner_optimizer": inner.state_dict(),
        "schedule": schedule.state_dict(),
        "objective": objective.state_dict(),
        "rng": rng,
        # Between syncs a fragment's local parameters run ahead of its global ones (fragments other than
        # the last synced, or alpha > 0); only those differ and need saving. Frozen weights have no global
        # copy and never change.
        "local_parameters": {
            name: p
            for name, p in model.named_parameters()
            if name in global_params and not torch.equal(p.detach(), global_params[name])
        },
    }


def restore_own(
    state: dict[str, Any],
    *,
    inner: torch.optim.Optimizer,
    objective: Objective,
    model: nn.Module,
    schedule: torch.optim.lr_scheduler.LRScheduler | None,
) -> None:
    """Load a replica's own saved state: inner optimizer, data position and RNG; with ``schedule`` (the state
    is of the round being resumed, not an older one), also the schedule and the local parameters."""
    inner.load_state_dict(state["inner_optimizer"])
    objective.load_state_dict(state["objective"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    if "cuda" in state["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    if schedule is None:
        return
    schedule.load_state_dict(state["schedule"])
    current = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in state["local_parameters"].items():
            current[name].copy_(value)
