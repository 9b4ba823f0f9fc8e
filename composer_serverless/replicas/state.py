"""A replica's state in the store: the global state it publishes and loads, and its own state it saves so that
a restarted replica (or a run whose replicas all died) continues exactly where it stopped.

The global state is what DiLoCo registered with the manager (per fragment, the global parameters and the
outer optimizer state) plus the sync step. A replica's own state is its inner optimizer, learning-rate
schedule, data position, RNG, and the local parameters that ran ahead of the global ones.

In a replica of several ranks (FSDP2) each rank keeps its own shards of both: a snapshot holds local tensors,
and the DTensors of the optimizers' state are rebuilt around them when it is loaded (``shards.py``).
"""

from __future__ import annotations

import logging
import random
from typing import Any

import torch
from torch import nn

from composer_serverless.accelerator.device import restore_rng_state, rng_state, synchronize
from composer_serverless.objectives.objective import Objective
from composer_serverless.rendezvous import checkpoint, layout
from composer_serverless.rendezvous.checkpoint import CheckpointError
from composer_serverless.rendezvous.latest import latest_round
from composer_serverless.rendezvous.manager import ObjectStoreManager
from composer_serverless.rendezvous.runkey import RunKey
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.replicas.diloco import global_parameters
from composer_serverless.replicas.node import SOLO, Node
from composer_serverless.replicas.shards import local, local_tree, reshard_optimizer_state

logger = logging.getLogger(__name__)

# States a replica tries to load before it gives up (each newer one pruned meanwhile, or each older one damaged).
MAX_STATE_TRIES = 5


def global_state(manager: ObjectStoreManager) -> dict[str, Any]:
    """What a replica publishes: this rank's shards of the global parameters and outer optimizer state."""
    return {"step": manager.current_step(), "user": local_tree(manager.user_state_dict())}


def load_global(
    store: ObjectStore,
    round_index: int,
    node: Node = SOLO,
    *,
    fall_back: bool = False,
    key: RunKey | None = None,
) -> dict[str, Any]:
    """This rank's part of the published state of ``round_index``, or of a newer round if that one was pruned
    meanwhile; every rank of the replica loads the same round (the lead's choice). With ``fall_back`` (a
    replica starting), a damaged state is passed over for the newest older one that is whole, so a restart
    does not fail on it again and again: the replica then catches up with the run from there.

    Raises:
        CheckpointError: no state could be read, each failure named.
    """
    problems: list[str] = []
    tried: set[int] = set()
    for _ in range(MAX_STATE_TRIES):
        round_index = node.broadcast(round_index)
        if round_index < 0:
            break
        tree, missing, problem = None, False, "unreadable on another rank of this replica"
        try:
            tree = checkpoint.load_global(store, round_index, node.local_rank, key)
        except FileNotFoundError:
            missing, problem = True, "not in the store (pruned meanwhile?)"
        except CheckpointError as e:
            problem = str(e)
        if node.all_true(tree is not None):
            return tree
        problems.append(f"round {round_index}: {problem}")
        tried.add(round_index)
        if node.lead:
            round_index = _next_to_try(store, round_index, tried, pruned=missing, fall_back=fall_back)
    raise CheckpointError(f"cannot read a global state from {store.url}: " + "; ".join(problems))


def _next_to_try(
    store: ObjectStore, round_index: int, tried: set[int], *, pruned: bool, fall_back: bool
) -> int:
    """After the state of ``round_index`` could not be read: the newer LATEST if it was pruned meanwhile; with
    ``fall_back`` the newest older state; else -1 (give up). Never a round ``tried`` already."""
    newer = latest_round(store)
    if pruned and newer > round_index and newer not in tried:
        return newer
    if not fall_back:
        return -1
    older = max(
        (int(n) for n in store.list(layout.STATE) if n.isdigit() and int(n) < round_index), default=-1
    )
    if older >= 0:
        logger.warning(
            "the state of round %d cannot be read; starting from that of round %d", round_index, older
        )
    return older


def apply_global(
    manager: ObjectStoreManager,
    names: list[dict[str, str]],
    model: nn.Module,
    state: dict[str, Any],
) -> None:
    """Load a published global state into DiLoCo's fragments, their outer optimizers (over host tensors: no
    shards to rebuild) and the model, and move the manager's step."""
    # DiLoCo fills its host copy of the global parameters asynchronously from the accelerator (when it is
    # built, after every sync): overwriting that copy while a copy into it is in flight would lose the load.
    synchronize(next(model.parameters()).device)
    user = state["user"]
    for i, mapping in enumerate(names):
        saved = set(user.get(f"StreamingDiLoCoFragment_{i}", {}).get("original_parameters", {}))
        if saved != set(mapping):
            raise CheckpointError(
                f"fragment {i} of the published state does not match this model's parameters"
            )
    for i in range(len(names)):
        originals = user[f"StreamingDiLoCoFragment_{i}"]["original_parameters"]
        if not all(bool(torch.isfinite(t).all()) for t in originals.values()):
            raise CheckpointError(
                f"fragment {i} of the published state step {state.get('step')} holds non-finite parameters: the "
                "run diverged before it was saved. Resume is impossible from it; launch a new run with a lower "
                "train.lr or diloco.outer_lr"
            )
    manager.load_user_state_dict(user)
    manager.set_step(int(state["step"]))
    params = global_parameters(manager, names)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in params:  # frozen weights are not part of the global state
                local(p).copy_(params[name])


def own_state(
    model: nn.Module,
    inner: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler,
    objective: Objective,
    global_params: dict[str, torch.Tensor],
    device: torch.device,
) -> dict[str, Any]:
    """What a replica saves of its own. ``global_params`` are DiLoCo's global copy, in host memory."""
    rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(), **rng_state(device)}
    # Between syncs a fragment's local parameters run ahead of its global ones (fragments other than the last
    # synced, or alpha > 0); only those differ and need saving. Frozen weights have no global copy and never
    # change. Compared on the host, where the global copy lives: each parameter is copied there once, which
    # saving it needs anyway.
    ahead = {}
    for name, p in model.named_parameters():
        if name in global_params:
            host = local(p).detach().cpu()
            if not torch.equal(host, global_params[name]):
                ahead[name] = host
    return {
        "inner_optimizer": local_tree(inner.state_dict()),
        "schedule": schedule.state_dict(),
        "objective": objective.state_dict(),
        "rng": rng,
        "local_parameters": ahead,
    }


def restore_own(
    state: dict[str, Any],
    *,
    inner: torch.optim.Optimizer,
    objective: Objective,
    model: nn.Module,
    schedule: torch.optim.lr_scheduler.LRScheduler | None,
    device: torch.device,
) -> None:
    """Load a replica's own saved state: inner optimizer, data position and RNG; with ``schedule`` (the state
    is of the round being resumed, not an older one), also the schedule's position and the local parameters.

    The schedule keeps its own peak learning rate and function (``make_schedule``, from the run's config)
    and takes only its position from the saved state: a resume may have changed train.lr, or the length a
    cosine decays over, and the saved state carries the old ones. Unchanged, the learning rate is the saved
    one to the bit (the same product LambdaLR computes)."""
    inner.load_state_dict(state["inner_optimizer"])
    reshard_optimizer_state(inner)
    objective.load_state_dict(state["objective"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    restore_rng_state(state["rng"], device)
    if schedule is None:
        return
    saved = state["schedule"]
    peaks = list(schedule.base_lrs)
    lrs = [
        peak * factor(saved["last_epoch"]) for peak, factor in zip(peaks, schedule.lr_lambdas, strict=True)
    ]
    schedule.load_state_dict({**saved, "base_lrs": peaks, "_last_lr": lrs})
    for group, peak, lr in zip(inner.param_groups, peaks, lrs, strict=True):
        group["initial_lr"], group["lr"] = peak, lr
    current = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in state["local_parameters"].items():
            local(current[name]).copy_(value)
